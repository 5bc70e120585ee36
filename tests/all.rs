//! The integration suite: one test binary, one module per area (`suite/`).

mod suite;
