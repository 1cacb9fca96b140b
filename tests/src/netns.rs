//! Network namespaces for data-path tests (filled by the init work).
