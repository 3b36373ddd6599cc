//! The **prepare** phase: parse the body once, tokenize, cut into block keys, and plan, on the
//! bounded blocking pool for a large body ([`crate::offload`]).

use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::fleet::Plan;
use kvroute_vllm::openai::{ApiError, GenerationRequest, parse_chat, parse_completion};

use super::{Refused, RequestContext};
use crate::service::{Prepared, Router};

/// Which OpenAI API a request used.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// Parses a generation request of either API.
pub fn parse(api: Api, body: &[u8]) -> Result<GenerationRequest, ApiError> {
    match api {
        Api::Completions => parse_completion(body),
        Api::Chat => parse_chat(body),
    }
}

/// Parses, tokenizes and plans once; a large body on the blocking pool.
pub(super) async fn prepare_and_plan(
    router: &Arc<Router>,
    api: Api,
    body: &Bytes,
    context: &RequestContext,
) -> Result<(Prepared, Plan), Refused> {
    let session = context.session.clone();
    if !router.offload().wanted(body.len()) {
        return prepare_here(router, api, body, session).await;
    }
    let (shared, body) = (router.clone(), body.clone());
    let runtime = tokio::runtime::Handle::current();
    let work = move || runtime.block_on(prepare_here(&shared, api, &body, session));
    router
        .offload()
        .run(work)
        .await
        .map_err(|_| offload_shed(router))?
}

/// Parses, tokenizes and plans on this thread.
async fn prepare_here(
    router: &Router,
    api: Api,
    body: &[u8],
    session: Option<String>,
) -> Result<(Prepared, Plan), Refused> {
    let parsed = parse(api, body)?;
    let Some(prepared) = router.prepare(&parsed, body.len(), session).await else {
        return Err(
            ApiError::not_found(format!("The model `{}` does not exist.", parsed.model)).into(),
        );
    };
    let plan = router.plan(&prepared);
    Ok((prepared, plan))
}

/// The blocking pool's queue is full: counted as shed, answered 503.
fn offload_shed(router: &Router) -> Refused {
    router
        .metrics()
        .shed
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: "offload_queue",
        })
        .inc();
    ApiError::unavailable("the router is preparing as many large requests as it may; retry shortly")
        .into()
}
