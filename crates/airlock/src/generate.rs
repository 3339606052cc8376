//! `airlock generate`: one prompt, streamed to stdout, with load progress and speed on stderr.

use anyhow::{Context, Result};
use gguf::ChatMessage;
use kv::{Owner, PagePool, PoolConfig, PoolSize, RequestId, TenantId};
use model::{GenerateRequest, Model, SamplingParams};
use model_args::ModelArgs;
use std::io::{IsTerminal, Write};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt text
    #[arg(long, env = "AIRLOCK_GENERATE_PROMPT")]
    prompt: String,
    /// Wrap the prompt in the model's chat template as a user message
    #[arg(long, env = "AIRLOCK_GENERATE_CHAT")]
    chat: bool,
    /// System message for --chat (default: the template's own)
    #[arg(long, env = "AIRLOCK_GENERATE_SYSTEM", requires = "chat")]
    system: Option<String>,
    /// Most tokens to generate
    #[arg(long, env = "AIRLOCK_GENERATE_MAX_TOKENS", default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, env = "AIRLOCK_GENERATE_TEMPERATURE", default_value_t = 0.0)]
    temperature: f32,
    /// Sample only from the k most likely tokens; 0 disables
    #[arg(long, env = "AIRLOCK_GENERATE_TOP_K", default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold; 1 disables
    #[arg(long, env = "AIRLOCK_GENERATE_TOP_P", default_value_t = 1.0)]
    top_p: f32,
    /// Random seed for sampling (same seed, same output)
    #[arg(long, env = "AIRLOCK_GENERATE_SEED", default_value_t = 0)]
    seed: u64,
    /// Stop when this text appears (repeatable); it is not printed
    #[arg(long, env = "AIRLOCK_GENERATE_STOP")]
    stop: Vec<String>,
    /// Keep generating past the end-of-sequence token
    #[arg(long, env = "AIRLOCK_GENERATE_IGNORE_EOS")]
    ignore_eos: bool,
    /// KV page size in tokens
    #[arg(long, env = "AIRLOCK_GENERATE_PAGE_SIZE", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=4096))]
    page_size: u16,
    /// KV pool capacity in tokens [default: the model's context length]
    #[arg(long, env = "AIRLOCK_GENERATE_KV_TOKENS")]
    kv_tokens: Option<usize>,
    /// Zero each KV page when it is freed (pages are reused as they are otherwise; every read
    /// is still checked against the page's owner)
    #[arg(long, env = "AIRLOCK_GENERATE_SCRUB_ON_FREE")]
    scrub_on_free: bool,
    /// Print the prompt's token ids to stderr
    #[arg(long, env = "AIRLOCK_GENERATE_SHOW_TOKENS")]
    show_tokens: bool,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: Args) -> Result<()> {
    let path = args.model.resolve_model()?;
    eprintln!("loading {}", path.display());
    let started = Instant::now();
    // A live counter on a terminal; nothing per tensor in a log.
    let live = std::io::stderr().is_terminal();
    let loaded = Model::load(&path, &args.model.load_options(), &mut |p| {
        if live {
            eprint!("\r  tensors {}/{}", p.tensors_done, p.tensors_total);
        }
    })
    .with_context(|| format!("loading {}", path.display()))?;
    let model = &loaded.model;
    eprintln!(
        "{}loaded in {:.2}s: {} layers, {} MiB of weights, {} threads, {} kernels",
        if live { "\r" } else { "" },
        started.elapsed().as_secs_f64(),
        model.config().layer_count,
        model.weight_bytes() >> 20,
        model.thread_count(),
        model.backend().name()
    );
    // Which file formats became which compute layout, and how faithfully.
    eprintln!("  weights: {}", model.weight_report().lines().join(", "));

    let text = if args.chat {
        let template = loaded
            .chat_template
            .as_ref()
            .context("this model has no chat template")?;
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
        template.render(&messages, true)?
    } else {
        args.prompt.clone()
    };
    let prompt = loaded.tokenizer.encode_prompt(&text, args.chat);
    if args.show_tokens {
        eprintln!("prompt tokens: {prompt:?}");
    }

    let layout = model.config().kv_layout(args.page_size as usize);
    let kv_tokens = args.kv_tokens.unwrap_or(model.config().context_length);
    let config = PoolConfig {
        layout,
        size: PoolSize::Tokens(kv_tokens),
        scrub_on_free: args.scrub_on_free,
    };
    let mut pool = PagePool::new(config).context("creating the KV pool (see --kv-tokens)")?;
    let needed = prompt.len().saturating_add(args.max_tokens);
    if needed <= model.config().context_length && needed > pool.capacity_tokens() {
        anyhow::bail!(
            "the prompt ({} tokens) plus --max-tokens {} needs {needed} KV tokens but the pool \
             holds {}; raise --kv-tokens or lower --max-tokens",
            prompt.len(),
            args.max_tokens,
            pool.capacity_tokens()
        );
    }
    let request = GenerateRequest {
        prompt,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..SamplingParams::greedy()
        },
        stop: args.stop.clone(),
        stop_at_eos: !args.ignore_eos,
        prefill_chunk: 512,
    };
    let owner = Owner {
        tenant: TenantId(0),
        request: RequestId(1),
    };
    let mut stdout = std::io::stdout().lock();
    let generated = model::generate(
        model,
        &loaded.tokenizer,
        &mut pool,
        owner,
        &request,
        &mut |piece| {
            // A closed stdout (e.g. piped into `head`) just stops the echo.
            let _ = stdout
                .write_all(piece.as_bytes())
                .and_then(|()| stdout.flush());
        },
    )?;
    let _ = writeln!(stdout);
    let s = &generated.stats;
    eprintln!(
        "prompt: {} tokens in {:.3}s ({:.1} tok/s); generated: {} tokens in {:.3}s ({:.1} tok/s); \
         finish: {:?}",
        s.prompt_tokens,
        s.prefill_seconds,
        s.prompt_tokens as f64 / s.prefill_seconds.max(1e-9),
        s.completion_tokens,
        s.decode_seconds,
        s.completion_tokens as f64 / s.decode_seconds.max(1e-9),
        generated.finish_reason
    );
    Ok(())
}
