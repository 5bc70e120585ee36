//! Hostile and malformed input against the real runnerd: every validation rule with its exact error.
