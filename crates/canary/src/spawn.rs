//! `--spawn`: an Airlock server started from this executable for the run, and stopped after.

use anyhow::Context;
use anyhow::Result;
use model_args::ModelArgs;
use std::io::BufRead;

use crate::base_url;
use crate::endpoint::get_json;
use crate::random_seed;
use crate::tenants::write_keys_file;
use crate::tenants::Tenant;
use crate::Args;
use crate::FALLBACK_CONTEXT;
use anyhow::bail;
use std::io::BufReader;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;
use std::time::Instant;

/// A server started from this executable, stopped (and its keys file removed) on drop.
pub(crate) struct Spawned {
    pub(crate) child: Child,
    pub(crate) url: String,
    pub(crate) dir: PathBuf,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Spawned {
    /// `airlock KIND` on a port the OS picks, with the tenants' keys, a context length (the
    /// flag's, else FALLBACK_CONTEXT: small prompts keep a run quick) and a pool that holds
    /// several full-context requests at once (and the shared system prompts); ready once it says where it serves and its
    /// /health answers 200.
    pub(crate) fn start(
        kind: &str,
        args: &Args,
        tenants: &[Tenant],
        runtime: &tokio::runtime::Runtime,
        client: &reqwest::Client,
    ) -> Result<Spawned> {
        let dir = std::env::temp_dir().join(format!(
            "airlock-canary-{}-{}",
            std::process::id(),
            random_seed()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let keys = match &args.keys_file {
            Some(path) => path.clone(),
            None => write_keys_file(&dir, tenants)?,
        };
        let model = ModelArgs {
            model: args.model_file.clone(),
            threads: args.threads,
            kernels: model_args::KernelChoice::AUTO,
        };
        let model_path = model.resolve_model()?;
        let context = args.context_length.unwrap_or(FALLBACK_CONTEXT);
        // Shared-system-prompt mode: each request in flight holds about the shared prompt,
        // and each tenant's copy stays cached; without room for those, requests queue for
        // pages and the run crawls.
        let shared = args.shared_prefix_tokens.unwrap_or(0) * (tenants.len() + args.concurrency);
        let kv_tokens = ((context * 4).min(16_384) + shared).max(context);
        let log = dir.join("server.log");
        let mut child = Command::new(std::env::current_exe()?)
            .args([kind, "--port", "0", "--host", "127.0.0.1"])
            .arg("--api-keys")
            .arg(&keys)
            .args(["--context-length", &context.to_string()])
            .args(["--kv-tokens", &kv_tokens.to_string()])
            .args(["--threads", &model.threads().to_string()])
            .arg("--model")
            .arg(&model_path)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting airlock {kind}"))?;
        let stdout = child.stdout.take().context("the server's stdout")?;
        let mut server = Spawned {
            child,
            url: String::new(),
            dir,
        };
        eprintln!("canary: starting airlock {kind} (context {context}, {kv_tokens} KV tokens)");
        server.url = server
            .wait_ready(stdout, runtime, client)
            .map_err(|error| {
                let tail = log_tail(&log);
                error.context(format!(
                    "airlock {kind} did not come up; its log ends:\n{tail}"
                ))
            })?;
        eprintln!("canary: airlock {kind} is serving at {}", server.url);
        Ok(server)
    }

    pub(crate) fn wait_ready(
        &mut self,
        stdout: std::process::ChildStdout,
        runtime: &tokio::runtime::Runtime,
        client: &reqwest::Client,
    ) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(180);
        let (tx, rx) = mpsc::channel();
        // Reads every line, so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some((_, url)) = line.split_once(" at http://") {
                    let _ = tx.send(format!("http://{}", url.trim()));
                }
            }
        });
        let url = loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("it exited ({status})");
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(url) => break base_url(&url)?,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => bail!("it never said where it serves"),
            }
        };
        while Instant::now() < deadline {
            if let Ok((200, _)) = runtime.block_on(get_json(client, &url, "/health", None)) {
                return Ok(url);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!("its /health never answered 200")
    }
}

/// The last lines of the server's log, for the error when it did not start.
pub(crate) fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}
