//! Any bytes as a Delta ADS request: no panic, and the agent's decoder agrees with prost's
//! generated one (fields, errors, and what it encodes again), whole or split in two.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lattice_agent::xds::check_delta_request(data);
});
