mod isolation;
mod lifecycle;
mod preflight;
