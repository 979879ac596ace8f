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
pub mod ops;
pub mod params;
pub mod store;
pub mod structured;

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
    /// Name served under `/v1/models`.
    pub model_name: String,
    /// Other names accepted as this model (agents often send their own model names).
    pub aliases: Vec<String>,
    pub api_key: Option<String>,
    /// Largest accepted request body in bytes.
    pub max_body: usize,
    /// Default `max_tokens` when a chat request gives none (None: the remaining context).
    pub default_max_tokens: Option<usize>,
    /// Unknown model names get a 404 (otherwise, with one model served, any name is accepted
    /// and echoed back: agents send their own vendor's names).
    pub strict_model_name: bool,
    /// Fields added to every request body that lacks them (`--request-defaults`).
    pub request_defaults: serde_json::Map<String, Value>,
    /// The most tokens any request may generate (None: what the context leaves).
    pub max_tokens_limit: Option<usize>,
    /// What the server keeps while it runs (stored responses, the grammar engine, counters).
    pub live: Live,
    /// Host/Origin checks, CORS, limits (see [`guard`]).
    pub guard: guard::Guard,
}

/// Server-side state built on demand or filled as requests come.
#[derive(Default)]
pub struct Live {
    pub responses: store::ResponseStore,
    pub grammar: std::sync::OnceLock<Result<Arc<dsv4_engine::GrammarEnv>, String>>,
    pub http: ops::HttpMetrics,
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
        let Value::Object(mut m) = v else {
            return Err(ApiError::bad(flavor, "the request body must be a JSON object"));
        };
        for (k, d) in &self.request_defaults {
            m.entry(k.clone()).or_insert_with(|| d.clone());
        }
        Ok(Value::Object(m))
    }

    /// Checks the `model` field and returns the name to echo back: the requested one when it
    /// names this model, an alias, or (unless `strict_model_name`) anything at all.
    pub fn check_model(&self, v: &Value, flavor: Flavor, required: bool) -> Result<String, ApiError> {
        match v.get("model") {
            None | Some(Value::Null) if !required => Ok(self.model_name.clone()),
            Some(Value::String(m)) if *m == self.model_name || self.aliases.contains(m) || !self.strict_model_name => {
                Ok(m.clone())
            }
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
    let mut text = s.engine.metrics.render();
    s.live.http.render(&mut text);
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

impl AppState {
    /// The grammar engine over this server's tokenizer (built on first use: a few hundred ms).
    pub fn grammar_env(&self, flavor: Flavor) -> Result<Arc<dsv4_engine::GrammarEnv>, ApiError> {
        self.live
            .grammar
            .get_or_init(|| {
                let json = self.tok.hf().to_string(false).map_err(|e| e.to_string())?;
                let json: Value = serde_json::from_str(&json).map_err(|e| e.to_string())?;
                dsv4_engine::GrammarEnv::from_tokenizer_json(&json, self.engine.vocab_size, self.tok.special.eos)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, flavor, e))
    }
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

/// `GET /v1/models/{id}` (both SDKs' `models.retrieve`).
async fn model(
    State(s): State<Shared>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let anthropic = headers.contains_key("anthropic-version");
    let flavor = if anthropic { Flavor::Anthropic } else { Flavor::OpenAi };
    if let Err(e) = s.authorize(&headers, flavor) {
        return e.into_response();
    }
    let known = id == s.model_name || s.aliases.contains(&id) || !s.strict_model_name;
    if !known {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            flavor,
            format!("model `{id}` does not exist; this server serves `{}`", s.model_name),
        )
        .into_response();
    }
    if anthropic {
        return axum::Json(
            serde_json::json!({"type": "model", "id": id, "display_name": id, "created_at": "1970-01-01T00:00:00Z"}),
        )
        .into_response();
    }
    axum::Json(serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "dsv4"})).into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, Flavor::OpenAi, format!("no route for {uri}")).into_response()
}

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/responses", post(openai::responses))
        .route("/v1/responses/{id}", get(store::get_response).delete(store::delete_response))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(openai::tokenize))
        .route("/v1/tokenize", post(openai::tokenize))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard::check_request))
        .layer(axum::middleware::from_fn_with_state(state.clone(), ops::track))
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
