//! The servers bench starts and stops itself, one at a time on the same cores.

use anyhow::Context;

use crate::measure::model_id;
use crate::Args;
use anyhow::bail;
use anyhow::Result;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) url: String,
    pub(crate) model_id: String,
    pub(crate) description: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `binary serve`, for the A/B guard comparison.
    pub(crate) fn start_serve(binary: &Path, args: &Args) -> Result<Server> {
        let model = args.model.resolve_model()?;
        let threads = args.model.threads().to_string();
        let port = args.port.to_string();
        let child = Command::new(binary)
            .args(["serve", "--port", &port, "--threads", &threads])
            .arg("--model")
            .arg(&model)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            model_id: model_args::DEFAULT_MODEL_NAME.to_string(),
            description: binary.display().to_string(),
        };
        server.wait_ready("serve", args.api_key.as_deref())?;
        Ok(server)
    }

    /// Starts `name` (serve, serve-tcp, unified, serve-nocache, unified-nocache or llama-cpp)
    /// on `--port`; a `-nocache` name runs with `--no-prefix-cache`, serve-tcp with
    /// `--kv-transport tcp`; llama-cpp's slots each hold `slot_context` tokens.
    pub(crate) fn start(name: &str, args: &Args, slot_context: usize) -> Result<Server> {
        let model = args.model.resolve_model()?;
        let threads = args.model.threads().to_string();
        let port = args.port.to_string();
        let url = format!("http://127.0.0.1:{port}");
        let (mut command, model_id) = match name {
            "serve" | "serve-tcp" | "unified" | "serve-nocache" | "unified-nocache" => {
                let mut command = Command::new(std::env::current_exe()?);
                let role = name.trim_end_matches("-nocache").trim_end_matches("-tcp");
                command.args([role, "--port", &port, "--threads", &threads]);
                command.arg("--model").arg(&model);
                if name.ends_with("-nocache") {
                    command.arg("--no-prefix-cache");
                }
                if name.ends_with("-tcp") {
                    command.args(["--kv-transport", "tcp"]);
                }
                if let Some(ms) = args.queue_timeout_ms {
                    command.args(["--queue-timeout-ms", &ms.to_string()]);
                }
                (command, model_args::DEFAULT_MODEL_NAME.to_string())
            }
            "llama-cpp" => {
                // llama.cpp's own server with a slot per request in flight, so it batches as
                // it would in production (llama-cpp-python's server runs one at a time).
                let slots = args.concurrency.iter().copied().max().unwrap_or(1).max(1);
                let mut command = Command::new(llama_server(args)?);
                command.args(["--host", "127.0.0.1", "--port", &port]);
                command.args(["-t", &threads, "-tb", &threads]);
                command.args(["-np", &slots.to_string()]);
                // -c is the whole KV cache, shared out among the slots.
                command.args(["-c", &(slots * slot_context).to_string()]);
                command.arg("-m").arg(&model);
                command.args(["--alias", "llama-cpp"]);
                (command, "llama-cpp".to_string())
            }
            other => bail!(
                "unknown server '{other}' (serve, unified, serve-nocache, unified-nocache, \
                 llama-cpp)"
            ),
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let mut server = Server {
            child,
            url,
            model_id,
            description: format!("{name} on port {port}, {threads} threads"),
        };
        server.wait_ready(name, args.api_key.as_deref())?;
        Ok(server)
    }

    /// Polls /v1/models until it answers; fails at once if the server exits first.
    pub(crate) fn wait_ready(&mut self, name: &str, key: Option<&str>) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("{name} exited before it served ({status}); run it by hand to see why");
            }
            if runtime.block_on(model_id(&self.url, key)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!("{name} did not come up at {} within 120 s", self.url)
    }
}

/// Where build-llama-server.sh puts llama.cpp's server by default.
pub(crate) const LLAMA_SERVER_BUILT: &str = "/tmp/llamacpp/build/bin/llama-server";

/// llama.cpp's `llama-server`: --llama-server, else `llama-server` on PATH, else where
/// scripts/bench/build-llama-server.sh builds it.
pub(crate) fn llama_server(args: &Args) -> Result<PathBuf> {
    if let Some(path) = &args.llama_server {
        if path.is_file() {
            return Ok(path.clone());
        }
        bail!("--llama-server {} is not a file", path.display());
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("llama-server"));
    let built = std::iter::once(PathBuf::from(LLAMA_SERVER_BUILT));
    on_path
        .chain(built)
        .find(|path| path.is_file())
        .with_context(|| {
            format!(
            "llama.cpp's llama-server is neither on PATH nor at {LLAMA_SERVER_BUILT}: build it \
             with scripts/bench/build-llama-server.sh (about 15 minutes on 2 cores), pass \
             --llama-server PATH, or leave llama-cpp out of --spawn"
        )
        })
}
