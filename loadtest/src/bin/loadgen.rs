//! `loadgen`: command-line front end of `loadtest::loadgen`. Runs one workload against a
//! gateway or worker on this machine and prints (and optionally writes) the report.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use loadtest::loadgen::overload::cli::{Common, OverloadArgs};
use loadtest::loadgen::{
    self, Api, Arrival, ChatParams, GspParams, InputIds, LoadConfig, MrqaParams, WorkloadKind,
};

#[derive(Clone, Copy, ValueEnum)]
enum WorkloadArg {
    Gsp,
    Mrqa,
    Chat,
    Trace,
    Rate,
    /// Two tenants, interactive and batch, on an overloaded fleet (see the overload flags).
    Overload,
}

#[derive(Clone, Copy, ValueEnum)]
enum ApiArg {
    Chat,
    Completions,
    Generate,
}

#[derive(Clone, Copy, ValueEnum)]
enum InputIdsArg {
    Approx,
    Bpe,
}

#[derive(Clone, Copy, ValueEnum)]
enum ArrivalArg {
    /// The workload's own schedule (gsp burst, mrqa staggered users, chat Poisson, trace
    /// timestamps, rate fixed).
    #[value(alias = "trace")]
    Schedule,
    Poisson,
    Fixed,
    Burst,
    Closed,
}

/// Load generator for LLM gateways: open-loop (latency from the intended send time) or closed
/// loop; shared-prefix, multi-round QA, chat-session, trace-replay and overhead workloads;
/// reports TTFT, ITL, E2E, throughput and the servers' prompt-cache hit rate.
#[derive(Parser)]
#[command(name = "loadgen", version)]
struct Cli {
    /// Base URL of the gateway or worker (loopback only).
    #[arg(long, default_value = "http://127.0.0.1:30000")]
    target: String,
    #[arg(long, value_enum, default_value = "chat")]
    workload: WorkloadArg,
    #[arg(long, value_enum, default_value = "chat")]
    api: ApiArg,
    /// With --api generate: send prompts as `input_ids`, tokenized as `sim-worker --tokenizer
    /// MODE` tokenizes (use the workers' mode), so a gateway measures them in tokens.
    #[arg(long, value_enum)]
    input_ids: Option<InputIdsArg>,
    /// Stream responses (SSE); the default.
    #[arg(long, overrides_with = "no_stream")]
    stream: bool,
    /// Ask for whole responses.
    #[arg(long, overrides_with = "stream")]
    no_stream: bool,
    #[arg(long, value_enum, default_value = "schedule")]
    arrival: ArrivalArg,
    /// Per-second rate: poisson/fixed arrivals, chat session starts, mrqa qps, rate requests
    /// (default 1; 10 for --workload rate). In unscaled seconds (see --time-scale).
    #[arg(long)]
    rate: Option<f64>,
    /// Users of the closed loop (--arrival closed).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Send window in seconds; nothing is sent after it.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Seconds granted to in-flight requests after the window.
    #[arg(long, default_value_t = 60.0)]
    drain: f64,
    /// Per-request timeout in seconds, from the intended send time.
    #[arg(long, default_value_t = 120.0)]
    request_timeout: f64,
    /// Workload size: first N gsp prompts / trace records / rate requests.
    #[arg(long)]
    num_requests: Option<u64>,
    /// Hard cap on requests sent.
    #[arg(long, default_value_t = 20_000)]
    max_requests: u64,
    /// Open loop: most requests outstanding; more are dropped and counted.
    #[arg(long, default_value_t = 4096)]
    max_inflight: usize,
    /// Send X-SMG-Routing-Key = the session (gsp: group) id.
    #[arg(long)]
    session_header: bool,
    /// Multiply think times, arrival gaps and trace timestamps (0.01 for CI).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `model` of OpenAI requests.
    #[arg(long, default_value = "default")]
    model: String,
    /// Trace file, or `conversation` / `synthetic` (from ../shared/traces).
    #[arg(long, default_value = "conversation")]
    trace: String,
    /// Multiply trace timestamps (2 = half speed).
    #[arg(long, default_value_t = 1.0)]
    trace_slowdown: f64,

    #[arg(long, default_value_t = GspParams::default().groups, help_heading = "gsp")]
    gsp_groups: u32,
    #[arg(long, default_value_t = GspParams::default().prompts_per_group, help_heading = "gsp")]
    gsp_prompts_per_group: u32,
    #[arg(long, default_value_t = GspParams::default().system_len, help_heading = "gsp")]
    gsp_system_len: u32,
    #[arg(long, default_value_t = GspParams::default().question_len, help_heading = "gsp")]
    gsp_question_len: u32,
    #[arg(long, default_value_t = GspParams::default().output_len, help_heading = "gsp")]
    gsp_output_len: u32,

    /// Users (each one session of --rounds turns).
    #[arg(long, default_value_t = MrqaParams::default().users, help_heading = "mrqa")]
    users: u32,
    #[arg(long, default_value_t = MrqaParams::default().rounds, help_heading = "mrqa")]
    rounds: u32,
    /// Shared system prompt, tokens.
    #[arg(long, default_value_t = MrqaParams::default().system_len, help_heading = "mrqa")]
    system_len: u32,
    /// Per-user context in the first message, tokens.
    #[arg(long, default_value_t = MrqaParams::default().history_len, help_heading = "mrqa")]
    history_len: u32,
    #[arg(long, default_value_t = MrqaParams::default().answer_len, help_heading = "mrqa")]
    answer_len: u32,

    /// Number of sessions (default: as many as start within --duration at --rate).
    #[arg(long, help_heading = "chat")]
    sessions: Option<u64>,
    #[arg(long, default_value_t = ChatParams::default().tenants, help_heading = "chat")]
    tenants: u32,
    /// Zipf exponent of tenant popularity (0 = uniform).
    #[arg(long, default_value_t = ChatParams::default().tenant_zipf, help_heading = "chat")]
    tenant_zipf: f64,
    #[arg(long, default_value_t = ChatParams::default().system_median, help_heading = "chat")]
    system_median: f64,
    /// Mean number of turns after the first.
    #[arg(long, default_value_t = ChatParams::default().extra_turns_mean, help_heading = "chat")]
    extra_turns: f64,
    /// Fewest turns of a session that is not one-shot.
    #[arg(long, default_value_t = ChatParams::default().min_turns, help_heading = "chat")]
    min_turns: u32,
    #[arg(long, default_value_t = ChatParams::default().max_turns, help_heading = "chat")]
    max_turns: u32,
    #[arg(long, default_value_t = ChatParams::default().one_shot_frac, help_heading = "chat")]
    one_shot_frac: f64,
    #[arg(long, default_value_t = ChatParams::default().doc_frac, help_heading = "chat")]
    doc_frac: f64,
    #[arg(long, default_value_t = ChatParams::default().docs, help_heading = "chat")]
    docs: u32,
    #[arg(long, default_value_t = ChatParams::default().context_frac, help_heading = "chat")]
    context_frac: f64,
    #[arg(long, default_value_t = ChatParams::default().context_median, help_heading = "chat")]
    context_median: f64,
    #[arg(long, default_value_t = ChatParams::default().question_median, help_heading = "chat")]
    question_median: f64,
    #[arg(long, default_value_t = ChatParams::default().answer_median, help_heading = "chat")]
    answer_median: f64,
    /// Median think time in unscaled seconds.
    #[arg(long, default_value_t = ChatParams::default().think_median_s, help_heading = "chat")]
    think_median: f64,

    #[command(flatten)]
    overload: OverloadArgs,

    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the markdown report here.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// No progress line and no report on stdout.
    #[arg(long)]
    quiet: bool,
}

impl Cli {
    fn config(self) -> LoadConfig {
        LoadConfig {
            target: self.target,
            workload: match self.workload {
                WorkloadArg::Gsp => WorkloadKind::Gsp,
                WorkloadArg::Mrqa => WorkloadKind::Mrqa,
                WorkloadArg::Chat => WorkloadKind::Chat,
                WorkloadArg::Trace => WorkloadKind::Trace,
                WorkloadArg::Rate => WorkloadKind::Rate,
                WorkloadArg::Overload => unreachable!("run by run_overload"),
            },
            api: match self.api {
                ApiArg::Chat => Api::Chat,
                ApiArg::Completions => Api::Completions,
                ApiArg::Generate => Api::Generate,
            },
            input_ids: self.input_ids.map(|m| match m {
                InputIdsArg::Approx => InputIds::Approx,
                InputIdsArg::Bpe => InputIds::Bpe,
            }),
            stream: !self.no_stream,
            arrival: match self.arrival {
                ArrivalArg::Schedule => Arrival::Schedule,
                ArrivalArg::Poisson => Arrival::Poisson,
                ArrivalArg::Fixed => Arrival::Fixed,
                ArrivalArg::Burst => Arrival::Burst,
                ArrivalArg::Closed => Arrival::Closed,
            },
            rate: self.rate,
            concurrency: self.concurrency,
            duration_s: self.duration,
            drain_s: self.drain,
            request_timeout_s: self.request_timeout,
            num_requests: self.num_requests,
            max_requests: self.max_requests,
            max_inflight: self.max_inflight,
            session_header: self.session_header,
            time_scale: self.time_scale,
            seed: self.seed,
            model: self.model,
            quiet: self.quiet,
            trace: self.trace,
            trace_slowdown: self.trace_slowdown,
            gsp: GspParams {
                groups: self.gsp_groups,
                prompts_per_group: self.gsp_prompts_per_group,
                system_len: self.gsp_system_len,
                question_len: self.gsp_question_len,
                output_len: self.gsp_output_len,
            },
            mrqa: MrqaParams {
                users: self.users,
                rounds: self.rounds,
                system_len: self.system_len,
                history_len: self.history_len,
                answer_len: self.answer_len,
            },
            chat: ChatParams {
                sessions: self.sessions,
                tenants: self.tenants,
                tenant_zipf: self.tenant_zipf,
                system_median: self.system_median,
                extra_turns_mean: self.extra_turns,
                min_turns: self.min_turns,
                max_turns: self.max_turns,
                one_shot_frac: self.one_shot_frac,
                doc_frac: self.doc_frac,
                docs: self.docs,
                context_frac: self.context_frac,
                context_median: self.context_median,
                question_median: self.question_median,
                answer_median: self.answer_median,
                think_median_s: self.think_median,
            },
        }
    }
}

fn main() -> ExitCode {
    // `loadgen streams ...`: the streaming benchmark's client, with flags of its own.
    if std::env::args_os().nth(1).is_some_and(|a| a == "streams") {
        return loadtest::streams::cli::main(std::env::args_os().skip(1));
    }
    let cli = Cli::parse();
    if matches!(cli.workload, WorkloadArg::Overload) {
        return run_overload(&cli);
    }
    let (json, markdown, quiet) = (cli.json.clone(), cli.markdown.clone(), cli.quiet);
    let cfg = cli.config();
    let report = match loadgen::run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let md = report.to_markdown();
    if !quiet {
        println!("{md}");
    }
    if let Some(p) = json {
        let text = match serde_json::to_string_pretty(&report) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("loadgen: cannot serialise the report: {e}");
                return ExitCode::from(2);
            }
        };
        if let Err(e) = std::fs::write(&p, text + "\n") {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
            return ExitCode::from(2);
        }
    }
    if let Some(p) = markdown {
        if let Err(e) = std::fs::write(&p, md) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
            return ExitCode::from(2);
        }
    }
    if report.ok == 0 {
        eprintln!(
            "loadgen: no request succeeded (errors: {:?})",
            report.error_examples
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// `--workload overload`: its own run and report (per tenant), written like the others.
fn run_overload(cli: &Cli) -> ExitCode {
    let cfg = cli.overload.config(Common {
        target: cli.target.clone(),
        model: cli.model.clone(),
        duration_s: cli.duration,
        drain_s: cli.drain,
        seed: cli.seed,
        max_inflight: cli.max_inflight,
    });
    let report = match loadgen::overload::run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let md = report.to_markdown();
    if !cli.quiet {
        println!("{md}");
    }
    let json = serde_json::to_string_pretty(&report).map(|t| t + "\n");
    let writes = [
        (cli.json.as_ref(), json.map_err(|e| e.to_string())),
        (cli.markdown.as_ref(), Ok(md)),
    ];
    for (path, text) in writes {
        let Some(p) = path else { continue };
        if let Err(e) = text.and_then(|t| std::fs::write(p, t).map_err(|e| e.to_string())) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
            return ExitCode::from(2);
        }
    }
    if report.interactive.ok + report.batch.ok == 0 {
        eprintln!("loadgen: no request succeeded");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
