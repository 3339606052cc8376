//! What the auditor asks the endpoint about itself before the run: its models and context.

use crate::send::clip;
use crate::send::read_capped;
use crate::BODY_CAP;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;

/// GET `path` with a bounded body, as JSON (None for any failure: these are hints).
pub(crate) async fn get_json(
    client: &reqwest::Client,
    url: &str,
    path: &str,
    key: Option<&str>,
) -> Result<(u16, serde_json::Value)> {
    let mut request = client.get(format!("{url}{path}"));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let (body, cut_short) = read_capped(response, BODY_CAP).await;
    if let Some(why) = cut_short {
        bail!("GET {path}: {why}");
    }
    let value = serde_json::from_slice(&body)
        .with_context(|| format!("GET {path}: HTTP {status}, body is not JSON"))?;
    Ok((status, value))
}

/// The first model's id from /v1/models, and its context length where the endpoint says
/// (vLLM's `max_model_len`).
pub(crate) async fn list_models(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
) -> Result<(String, Option<usize>)> {
    let (status, body) = get_json(client, url, "/v1/models", key).await?;
    if !(200..300).contains(&status) {
        bail!("HTTP {status}: {}", clip(&body.to_string(), 200));
    }
    let model = &body["data"][0];
    let id = model["id"].as_str().context("no model listed")?;
    let context = model["max_model_len"].as_u64().map(|n| n as usize);
    Ok((clip(id, 256), context))
}

/// Our /health's context length: the smallest of the router's and each linked worker's (the
/// detailed view, which needs a key where the server has keys).
pub(crate) async fn health_context(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
) -> Option<usize> {
    let (_, body) = get_json(client, url, "/health", key).await.ok()?;
    let workers = body["workers"].as_array().into_iter().flatten();
    std::iter::once(&body["context_length"])
        .chain(workers.map(|w| &w["context_length"]))
        .filter_map(serde_json::Value::as_u64)
        .filter(|&n| n > 0)
        .min()
        .map(|n| n as usize)
}
