mod http_api;
mod http_hostile;
mod isolation;
mod lifecycle;
mod managed;
mod network;
mod preflight;
mod remote;
