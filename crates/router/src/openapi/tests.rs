use super::*;
use crate::error::ApiError;
use std::collections::BTreeSet;
use std::time::Duration;

fn config() -> RouterConfig {
    RouterConfig {
        model_id: "smol".into(),
        context_length: 512,
        body_bytes_max: 1 << 20,
        default_max_tokens: 16,
        sampling_defaults: Default::default(),
        in_flight_max: 8,
        start_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(1),
        cors_allow_origins: Vec::new(),
        prefix_cache: true,
        retries: 2,
    }
}

fn operations(document: &Value) -> BTreeSet<(String, String)> {
    let paths = document["paths"].as_object().expect("paths");
    let mut operations = BTreeSet::new();
    for (path, item) in paths {
        for method in item.as_object().expect("path item").keys() {
            operations.insert((method.to_uppercase(), path.clone()));
        }
    }
    operations
}

#[test]
fn the_document_describes_exactly_the_routes_served() {
    let served: BTreeSet<(String, String)> = crate::server::routes()
        .iter()
        .map(|route| (route.method.to_string(), route.path.to_string()))
        .collect();
    let documented = operations(&document(&config(), 100));
    assert_eq!(served, documented, "served routes vs documented operations");
}

#[test]
fn the_request_schemas_carry_this_deployments_limits() {
    let document = document(&config(), 100);
    let schemas = &document["components"]["schemas"];
    for request in ["ChatRequest", "CompletionRequest"] {
        let own = &schemas[request]["allOf"][1];
        // The one model served, or none named (it answers either way).
        assert_eq!(
            own["properties"]["model"]["enum"],
            json!(["smol", null]),
            "{request}"
        );
        assert_eq!(
            own["properties"]["model"]["type"],
            json!(["string", "null"]),
            "{request}"
        );
        let required = own["required"].as_array().expect("required");
        assert!(!required.contains(&json!("model")), "{request}");
    }
    let max_tokens = &schemas["Common"]["properties"]["max_tokens"];
    assert_eq!(
        (
            max_tokens["minimum"].as_i64(),
            max_tokens["maximum"].as_i64()
        ),
        // 0 only with echo (the prompt alone).
        (Some(0), Some(511))
    );
    let token_ids = &schemas["Prompt"]["oneOf"][2]["items"];
    assert_eq!(
        (token_ids["type"].as_str(), token_ids["maximum"].as_i64()),
        (Some("integer"), Some(99))
    );
    let temperature = &schemas["Common"]["properties"]["temperature"];
    assert_eq!(
        (
            temperature["minimum"].as_f64(),
            temperature["maximum"].as_f64()
        ),
        (Some(0.0), Some(2.0))
    );
}

/// Every status a generation request can get from `ApiError` is documented on both
/// generation routes, with the error body (the edge's own 404/405 and the never-sent 499 for
/// a client gone aside).
#[test]
fn every_error_a_generation_can_answer_is_documented() {
    let document = document(&config(), 100);
    let message = String::new;
    let errors = [
        ApiError::invalid("x", "n"),
        ApiError::ContextLengthExceeded {
            message: message(),
            param: "prompt",
        },
        ApiError::Unauthorized,
        ApiError::ModelNotFound {
            model: message(),
            served: message(),
        },
        ApiError::BodyTooLarge { limit_bytes: 1 },
        ApiError::BodyTimeout {
            timeout: Duration::from_secs(1),
        },
        ApiError::UnsupportedMediaType,
        ApiError::HeadersTooLarge { limit_bytes: 1 },
        ApiError::RateLimited { message: message() },
        ApiError::Overloaded { message: message() },
        ApiError::NoWorkers { message: message() },
        ApiError::TransferFailed { message: message() },
        ApiError::Timeout { message: message() },
        ApiError::Cancelled,
        ApiError::Internal,
    ];
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let responses = &document["paths"][path]["post"]["responses"];
        for error in &errors {
            let status = error.status().as_u16().to_string();
            let schema = &responses[&status]["content"]["application/json"]["schema"];
            assert_eq!(
                schema["$ref"], "#/components/schemas/ErrorBody",
                "{path} {status}"
            );
        }
        let ok = &responses["200"]["content"];
        assert!(
            ok.get("text/event-stream").is_some(),
            "{path} streams: {ok}"
        );
        assert!(ok.get("application/json").is_some(), "{path}: {ok}");
    }
}

#[test]
fn the_bearer_key_is_required_where_the_server_requires_it() {
    let document = document(&config(), 100);
    let scheme = &document["components"]["securitySchemes"]["bearer"];
    assert_eq!(
        (scheme["type"].as_str(), scheme["scheme"].as_str()),
        (Some("http"), Some("bearer"))
    );
    let security = |method: &str, path: &str| document["paths"][path][method]["security"].clone();
    for (method, path) in [
        ("post", "/v1/chat/completions"),
        ("post", "/v1/completions"),
        ("get", "/v1/models"),
    ] {
        assert_eq!(security(method, path), json!([{"bearer": []}]), "{path}");
    }
    // `/health` answers anyone, more with a key.
    assert_eq!(security("get", "/health"), json!([{}, {"bearer": []}]));
    for path in ["/health/live", "/health/ready", "/metrics", "/openapi.json"] {
        assert_eq!(security("get", path), Value::Null, "{path} needs no key");
    }
}
