//! The HTTP server: OpenAI (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`) and
//! Anthropic (`/v1/messages`) APIs over the continuous-batching engine, plus `/health`,
//! `/v1/models` and Prometheus `/metrics`.

pub mod anthropic;
pub mod chat;
pub mod error;
pub mod gen;
pub mod guard;
pub mod openai;
pub mod openai_chat;
pub mod params;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use dsv4_engine::EngineHandle;
use dsv4_tokenizer::Tokenizer;
use error::{ApiError, Flavor};
use serde_json::Value;
use std::sync::Arc;

/// Everything a handler needs.
pub struct AppState {
    pub engine: EngineHandle,
    pub tok: Tokenizer,
    /// Name served under `/v1/models`; requests naming another model get a 404.
    pub model_name: String,
    /// Other names accepted as this model (agents often send their own model names).
    pub aliases: Vec<String>,
    pub api_key: Option<String>,
    /// Largest accepted request body in bytes.
    pub max_body: usize,
    /// Default `max_tokens` when a chat request gives none.
    pub default_max_tokens: usize,
    /// Host/Origin checks, CORS, limits (see [`guard`]).
    pub guard: guard::Guard,
}

pub type Shared = Arc<AppState>;

impl AppState {
    /// Checks the API key (`Authorization: Bearer` or `x-api-key`).
    pub fn authorize(&self, headers: &HeaderMap, flavor: Flavor) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        if guard::key_matches(headers, key) {
            Ok(())
        } else {
            Err(ApiError::new(StatusCode::UNAUTHORIZED, flavor, "invalid or missing API key"))
        }
    }

    /// Reads and parses the JSON body, within the size limit, after the auth check.
    pub async fn body(&self, headers: &HeaderMap, body: Body, flavor: Flavor) -> Result<Value, ApiError> {
        self.authorize(headers, flavor)?;
        let bytes = guard::read_body(self, body, flavor).await?;
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(flavor, format!("invalid JSON body: {e}")))?;
        if !v.is_object() {
            return Err(ApiError::bad(flavor, "the request body must be a JSON object"));
        }
        Ok(v)
    }

    /// The `model` field must name this model (or an alias).
    pub fn check_model(&self, v: &Value, flavor: Flavor, required: bool) -> Result<(), ApiError> {
        match v.get("model") {
            None | Some(Value::Null) if !required => Ok(()),
            Some(Value::String(m)) if *m == self.model_name || self.aliases.contains(m) => Ok(()),
            Some(Value::String(m)) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                flavor,
                format!("model `{m}` does not exist; this server serves `{}`", self.model_name),
            )
            .param("model")),
            Some(other) => {
                Err(ApiError::bad(flavor, format!("`model` must be a string, found {other}")).param("model"))
            }
            None => Err(ApiError::bad(flavor, "`model` is required").param("model")),
        }
    }
}

/// 200 only while the engine thread runs: a server whose engine died must not look alive.
async fn health(State(s): State<Shared>) -> Response {
    if s.engine.is_alive() {
        axum::Json(serde_json::json!({"status": "ok"})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "engine stopped"}))).into_response()
    }
}

async fn metrics(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if s.guard.metrics_auth {
        if let Err(e) = s.authorize(&headers, Flavor::OpenAi) {
            return e.into_response();
        }
    }
    ([("content-type", "text/plain; version=0.0.4")], s.engine.metrics.render()).into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = s.authorize(&headers, Flavor::OpenAi) {
        return e.into_response();
    }
    let data: Vec<Value> = std::iter::once(&s.model_name)
        .chain(&s.aliases)
        .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "dsv4"}))
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, Flavor::OpenAi, format!("no route for {uri}")).into_response()
}

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/responses", post(openai::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/tokenize", post(openai::tokenize))
        .route("/v1/tokenize", post(openai::tokenize))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard::check_request))
        .with_state(state)
}

/// Serves until SIGINT or SIGTERM (or until the engine stops: then an error, so the process
/// exits non-zero instead of answering 503 forever).
pub async fn serve(state: Shared, addr: std::net::SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    let engine = state.engine.clone();
    let dead = {
        let engine = engine.clone();
        async move {
            while engine.is_alive() {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    let limits = state.guard.limits.clone();
    let drain = std::time::Duration::from_secs(30);
    guard::serve(listener, router(state), limits, guard::shutdown_signal(dead), drain).await?;
    if !engine.is_alive() {
        return Err(std::io::Error::other("the engine thread stopped"));
    }
    Ok(())
}

/// Seconds since the Unix epoch (response `created` fields).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
