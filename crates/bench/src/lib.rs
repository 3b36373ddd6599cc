//! `kvroute bench`: measure a workload against any OpenAI-compatible endpoint (a router, a
//! load balancer, one vLLM server) and report it so that runs can be compared side by side.

pub mod ceiling;
pub mod driver;
pub mod lines;
pub mod report;
pub mod result;
pub mod stats;
pub mod targets;
pub mod trace;
pub mod workload;
