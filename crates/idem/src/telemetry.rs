//! OpenTelemetry traces: spans exported over OTLP (HTTP/protobuf) when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, named by
//! `OTEL_SERVICE_NAME` (default `idem`); off otherwise. The library crates only open `tracing`
//! spans (`idempotency.request`, `idempotency.store`); this module turns them into
//! OpenTelemetry spans, and carries W3C `traceparent` in (from a client's request or a
//! message's headers) and out (to the upstream or the handler).
//!
//! The exporter's other standard variables apply as the OpenTelemetry SDK reads them
//! (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_SCHEDULE_DELAY`, …). An `https://` collector is
//! verified against the system's trust store (`SSL_CERT_FILE` names a private CA's bundle).

use std::sync::atomic::{AtomicBool, Ordering};

use http::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The exporter, kept to flush what is left at exit.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Whether [`Telemetry::start`] set up the exporter: read on every request, instead of the
/// environment.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported ([`Telemetry::start`] set up the exporter): without, the binary
/// opens no spans of its own.
#[must_use]
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Whether an OTLP endpoint is configured in the environment.
#[must_use]
pub fn configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()))
}

impl Telemetry {
    /// The OTLP exporter and the `tracing` layer that feeds it, when [`configured`].
    ///
    /// # Errors
    ///
    /// [`TelemetryError`]: the exporter cannot be built (an endpoint that is no URL, say).
    pub fn start<S>() -> Result<(Self, Option<impl tracing_subscriber::Layer<S>>), TelemetryError>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        if !configured() {
            return Ok((Self::default(), None));
        }
        // An https:// collector: the exporter's client takes the process's rustls provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(TelemetryError)?;
        let mut resource = opentelemetry_sdk::Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name("idem");
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("idem");
        EXPORTING.store(true, Ordering::Relaxed);
        let layer = tracing_opentelemetry::layer().with_tracer(tracer);
        Ok((
            Self {
                provider: Some(provider),
            },
            Some(layer),
        ))
    }

    /// Exports the spans still waiting (at exit).
    pub fn shutdown(&self) {
        if let Some(provider) = &self.provider
            && let Err(error) = provider.shutdown()
        {
            tracing::warn!(%error, "the last spans could not be exported");
        }
    }
}

/// Why the OTLP trace exporter could not be built; the process runs on without exporting.
#[derive(Debug, thiserror::Error)]
#[error("the OTLP trace exporter: {0}")]
pub struct TelemetryError(#[source] opentelemetry_otlp::ExporterBuildError);

struct HeaderExtractor<'h>(&'h HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'h>(&'h mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Makes `span` continue the trace of the W3C `traceparent` in `headers`, when there is a valid
/// one (a malformed one is ignored: the span starts a trace of its own).
pub fn continue_from(span: &tracing::Span, headers: &HeaderMap) {
    if !exporting() || !headers.contains_key("traceparent") {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let _ = span.set_parent(parent);
}

/// Puts the current span's `traceparent` (and `tracestate`) into `headers`, replacing what
/// came in, when traces are exported; otherwise leaves `headers` as they are (a client's
/// `traceparent` then passes through unchanged).
pub fn propagate(headers: &mut HeaderMap) {
    if !exporting() {
        return;
    }
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields` (the message and the event's
    /// fields), `target` and the spans it is in.
    Json,
}

/// Sends logs to standard error, filtered by `IDEM_LOG` (`tracing-subscriber`'s `EnvFilter`
/// syntax: `debug`, `warn,idempotency=debug`, …; directives that do not parse are ignored) or,
/// without it, at `default` and above; and spans to the OpenTelemetry exporter when one is
/// configured ([`Telemetry::start`]). The returned [`Telemetry`] flushes the spans at
/// [`Telemetry::shutdown`].
#[must_use]
pub fn init_logging(default: tracing::Level, format: LogFormat) -> Telemetry {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::from_level(default).into())
        .with_env_var("IDEM_LOG")
        .from_env_lossy();
    // Colours only on a terminal: a log file or a collector would keep the escape codes.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = match format {
        LogFormat::Text => fmt.with_target(false).boxed(),
        // JSON lines carry their target: `idempotency_http::request` marks the request events.
        LogFormat::Json => fmt.json().with_current_span(false).with_span_list(false).boxed(),
    };
    // Spans go to the exporter whatever IDEM_LOG says of the log lines.
    let (telemetry, traces) = match Telemetry::start() {
        Ok(started) => started,
        Err(error) => {
            eprintln!("idem: warning: traces are not exported: {error}");
            (Telemetry::default(), None)
        }
    };
    let traces = traces.map(|layer| layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(traces)
        .init();
    telemetry
}
