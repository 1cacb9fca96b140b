//! Any bytes, as a query over UDP and TCP and as an upstream answer: no panic, replies parse,
//! fit the client's limit, and the fast path agrees with the general path.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lattice_dns::check_query(data);
});
