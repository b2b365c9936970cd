"""vLLM's ``vllm serve`` flags that pagedkv does not take as its own: each is either accepted as a
no-op with a one-line warning (it cannot matter here) or refused with an error that names it and
says why, printed with ``serve``'s usage. Flags pagedkv has (``--max-model-len``, ``--api-key``,
``--allowed-origins``...) work as vLLM's; ``tests/server/test_vllm_flags.py`` checks that every flag of
vLLM 0.32.0's ``vllm serve --help=all`` (``tests/data/vllm_0.32.0_serve_help.txt``) is one of the
three.

Also vLLM's rules kept at start-up: ``--max-model-len`` beyond the model's own context is refused
unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` (or ``PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN=1``), and the
sampling defaults of ``--override-generation-config`` / ``--max-tokens-default``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from pagedkv import envs

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

# vLLM's short spellings of flags pagedkv has
ALIASES = {"-q": "--quantization", "-sc": "--speculative-config"}


Harmless = Callable[[Any, argparse.Namespace], bool]  # (the flag's value, all flags) -> a no-op here?


def _always(value: Any, args: argparse.Namespace) -> bool:
    return True


def _never(value: Any, args: argparse.Namespace) -> bool:
    return False


def _one(value: Any, args: argparse.Namespace) -> bool:
    return str(value).strip() == "1"


def _off(value: Any, args: argparse.Namespace) -> bool:
    return value is False or str(value).lower() in ("0", "false", "none", "")


def _on_cpu(value: Any, args: argparse.Namespace) -> bool:
    return (getattr(args, "device", None) or "cpu") == "cpu"


def _among(*ok: str) -> Harmless:
    return lambda value, args: str(value).lower() in ok


@dataclass(frozen=True, slots=True)
class VLLMFlag:
    """One vLLM flag pagedkv does not implement. ``harmless(value)``: True, a no-op here (a warning
    says why); False, refused with ``why``. ``switch``: a flag without a value (``--no-NAME`` too)."""

    name: str
    why: str
    harmless: Harmless = _never
    switch: bool = False

    @property
    def dest(self) -> str:
        return "vllm_" + self.name.lstrip("-").replace("-", "_")


def _group(why: str, harmless: Harmless, values: str = "", switches: str = "") -> list[VLLMFlag]:
    return ([VLLMFlag(n, why, harmless) for n in values.split()]
            + [VLLMFlag(n, why, harmless, switch=True) for n in switches.split()])


_GPU = "pagedkv has no CUDA graphs, torch.compile passes or GPU kernels to tune"
_PARALLEL = ("pagedkv runs one engine over one device or, with --tensor-parallel-size, over tensor-parallel ranks: "
             "no pipeline, data, context or expert parallelism (1 is accepted)")
_MM = "pagedkv serves text-only decoder models: no images, audio or video"
_POOLING = "pagedkv generates text: no pooling, embedding or scoring runners"
_REMOTE = ("pagedkv implements its supported architectures itself (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3 and "
           "their relatives) and never runs a model's own code")

FLAGS: dict[str, VLLMFlag] = {f.name: f for f in [
    # -- accepted, no effect here --------------------------------------------------------------
    *_group(_REMOTE, _always, switches="--trust-remote-code"),
    *_group("the KV pool is sized by --kv-cache-memory-bytes or --num-kv-blocks, not by a share of GPU memory",
            _on_cpu, values="--gpu-memory-utilization --device-memory-utilization"),
    *_group(_PARALLEL, _one, values="--pipeline-parallel-size -pp --data-parallel-size -dp "
            "--data-parallel-size-local -dpl --decode-context-parallel-size -dcp --api-server-count -asc "
            "--prefill-context-parallel-size -pcp"),
    *_group(_PARALLEL, _off, values="--data-parallel-rank -dpn --data-parallel-start-rank -dpr",
            switches="--enable-expert-parallel -ep --enable-eplb --data-parallel-hybrid-lb -dph "
            "--data-parallel-external-lb -dpe --headless"),
    *_group(_GPU + ": every step runs eagerly already", _always,
            values="--compilation-config -cc -O --max-seq-len-to-capture --cuda-graph-sizes --cudagraph-capture-sizes "
            "--max-cudagraph-capture-size --optimization-level",
            switches="--enforce-eager --disable-custom-all-reduce --async-scheduling "
            "--enable-dbo --calculate-kv-scales --use-tqdm-on-load --disable-sliding-window "
            "--disable-hybrid-kv-cache-manager --kv-sharing-fast-prefill --ray-workers-use-nsight"),
    *_group("pagedkv always chunks long prompts (--max-num-batched-tokens is the chunk budget)", _always,
            switches="--enable-chunked-prefill --disable-chunked-mm-input"),
    *_group("pagedkv runs in one process", _always, values="--distributed-executor-backend "
            "--max-parallel-loading-workers --worker-cls --worker-extension-cls --data-parallel-backend -dpb "
            "--data-parallel-address -dpa --data-parallel-rpc-port -dpp --dbo-decode-token-threshold "
            "--dbo-prefill-token-threshold", switches="--disable-frontend-multiprocessing"),
    *_group("requests are logged by pagedkv's own request lines (--disable-log-requests turns them off)", _always,
            values="--max-log-len", switches="--disable-uvicorn-access-log --enable-log-outputs "
            "--aggregate-engine-logging --log-error-stack"),
    *_group("pagedkv serves no API docs pages, and always reports cached prompt tokens in usage", _always,
            switches="--disable-fastapi-docs --enable-prompt-tokens-details --enable-server-load-tracking"),
    *_group("pagedkv reads safetensors folders and GGUF files itself", _among("auto", "safetensors", "gguf"),
            values="--load-format"),
    *_group("pagedkv has one tokenizer implementation (Hugging Face tokenizers)", _among("auto", "hf", "fast"),
            values="--tokenizer-mode"),
    *_group(_POOLING, _among("auto", "generate"), values="--runner --task"),
    *_group(_POOLING, _among("none", "auto"), values="--convert"),
    *_group("pagedkv's queues order by priority always (lower first, as vLLM's priority policy); fcfs is the "
            "case of equal priorities", _among("fcfs", "priority"), values="--scheduling-policy"),
    *_group("pagedkv's structured output always uses llguidance", _always,
            values="--structured-outputs-config --guided-decoding-backend"),
    *_group("pagedkv hashes blocks with SHA-256 always", _among("sha256", "sha256_cbor", "builtin"),
            values="--prefix-caching-hash-algo"),
    *_group("pagedkv keeps the mamba state of no model (no state-space models)", _among("auto"),
            values="--mamba-cache-dtype --mamba-ssm-cache-dtype"),
    *_group("the model's own architecture implementation is pagedkv's", _among("auto", "vllm"),
            values="--model-impl"),
    *_group(_MM, _off, values="--limit-mm-per-prompt --mm-processor-cache-gb --mm-processor-kwargs --media-io-kwargs "
            "--mm-encoder-tp-mode --mm-processor-cache-type --mm-shm-cache-max-object-size-mb --video-pruning-rate "
            "--allowed-local-media-path --allowed-media-domains --default-mm-loras --mm-encoder-attn-backend",
            switches="--interleave-mm-strings --skip-mm-profiling --disable-mm-preprocessor-cache "
            "--enable-multimodal-encoder-data-parallel --enable-mm-embeds"),
    *_group("off is pagedkv's behaviour: tools are called only with --enable-auto-tool-choice", _off,
            switches="--no-enable-auto-tool-choice"),
    *_group(_PARALLEL, _off, values="--nnodes -n --node-rank -r --master-addr --master-port --device-ids "
            "--data-parallel-supervisor-port --dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s "
            "--dp-supervisor-probe-timeout-s --dp-sync-interval --elastic-ep-max-dp-size --all2all-backend "
            "--dcp-comm-backend --dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size "
            "--distributed-timeout-seconds --cpu-distributed-timeout-seconds --ubatch-size",
            switches="--data-parallel-multi-port-external-lb -dpm --dcp-q-replicate "
            "--disable-nccl-for-dp-synchronization --enable-elastic-ep --enable-ep-weight-filter --enable-hc-sp "
            "--enable-nccl-comm-suspend --enable-scale-out --enable-fault-tolerance --enable-batch-sharded-sampling"),
    *_group(_GPU, _always, values="--attention-backend --attention-config -ac --linear-backend --moe-backend "
            "--mamba-backend --gdn-prefill-backend --kda-decode-backend --kda-prefill-backend "
            "--sparse-indexer-topk-backend --ir-op-priority --kernel-config --performance-mode --jit-monitor-mode "
            "--profiler-config", switches="--enable-flashinfer-autotune --enable-cumem-allocator "
            "--enable-shm-tensor-arena --sleep-mode-offload-cudagraph --jit-monitor-verbose "
            "--enable-layerwise-nvtx-tracing --cudagraph-metrics --enable-mfu-metrics --enable-trace-replay "
            "--use-fp64-gumbel"),
    *_group("pagedkv loads safetensors with its own reader", _always,
            values="--safetensors-prefetch-block-size --safetensors-prefetch-num-threads --renderer-num-workers"),
    *_group("NUMA placement is the operator's (numactl, taskset); pagedkv's --threads sets its CPU threads", _off,
            values="--numa-bind-cpus --numa-bind-nodes", switches="--numa-bind"),
    *_group("pagedkv is a text model server: it runs the language model only", _always,
            switches="--language-model-only"),
    *_group(_MM, _off, values="--mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-margin "
            "--mm-encoder-fp8-scale-save-path --mm-hasher-algorithm --mm-ipc-gpu-memory-gb --mm-processor-device "
            "--mm-tensor-ipc --video-pruning-method", switches="--mm-device-do-normalize --mm-encoder-only "
            "--trust-request-mm-kwargs"),
    *_group("pagedkv keeps the state of no state-space model (mamba, linear attention)", _off,
            values="--mamba-block-size --mamba-cache-mode --mamba-cache-philox-rounds --mamba-ssu-algorithm "
            "--replayssm-buffer-len", switches="--enable-mamba-cache-stochastic-rounding "
            "--enable-mamba-shared-prefix-checkpoint --use-replayssm --swa-bounded-replay"),
    *_group("no shutdown timeout here: SIGTERM drains for --drain-timeout seconds", _never,
            values="--shutdown-timeout"),
    # -- refused: they would change what a client gets, and pagedkv cannot do it ----------------
    *_group("no Unix-socket listener: give --host and --port", _never, values="--uds"),
    *_group("pagedkv's API exposes no custom ASGI middleware: put a proxy in front", _never, values="--middleware"),
    *_group("no per-request X-Request-Id headers yet", _never, switches="--enable-request-id-headers"),
    *_group("no OpenTelemetry tracing: the request lines and /metrics carry the timings", _never,
            values="--otlp-traces-endpoint --collect-detailed-traces"),
    *_group("the logging setup is --log-level and --log-format json", _never, values="--log-config-file"),
    *_group("tool-parser and reasoning-parser plugins are not loaded (pagedkv's parsers: --tool-call-parser)",
            _never, values="--tool-parser-plugin --reasoning-parser-plugin --tool-server --io-processor-plugin "
            "--logits-processors --logits-processor-pattern"),
    *_group("messages' content must be strings or text parts here (the chat template sees strings)",
            _among("auto", "string"), values="--chat-template-content-format"),
    *_group("the assistant role is always \"assistant\"", _among("assistant"), values="--response-role"),
    *_group("token ids are not returned as strings in logprobs", _never, switches="--return-tokens-as-token-ids"),
    *_group("usage is sent when a request asks for it (stream_options.include_usage)", _never,
            switches="--enable-force-include-usage"),
    *_group("a request cannot bring its own chat template here", _never, switches="--trust-request-chat-template "
            "--exclude-tools-when-tool-choice-none --enable-tokenizer-info-endpoint"),
    *_group("logprobs are capped at 20 per token, as OpenAI's API", _never, values="--max-logprobs --logprobs-mode"),
    *_group("pagedkv reads a model's config as written: no overrides of its configuration", _never,
            values="--hf-overrides --hf-config-path --rope-scaling --rope-theta --config-format --code-revision "
            "--tokenizer-revision --override-attention-dtype --pooler-config --override-pooler-config "
            "--additional-config --model-loader-extra-config --ignore-patterns --pt-load-map-location "
            "--safetensors-load-strategy --config"),
    *_group("pagedkv takes text or token-id prompts: no prompt embeddings, and the tokenizer is always loaded",
            _never, switches="--enable-prompt-embeds --skip-tokenizer-init"),
    *_group("no sleep mode: stop the process to free its memory", _never, switches="--enable-sleep-mode"),
    *_group("no offloading of weights: the KV cache's host tier is --kv-offloading-size", _never,
            values="--cpu-offload-gb --kv-offloading-backend --offload-group-size --offload-num-in-group "
            "--offload-prefetch-step --offload-params"),
    *_group("no disaggregated prefill: KV is not sent to or received from other instances (KV events are: "
            "--kv-events-config)", _never, values="--kv-transfer-config --ec-transfer-config"),
    *_group("the scheduler is pagedkv's own; its prefill chunking is --max-num-batched-tokens and --max-step-time-s",
            _never, values="--scheduler-cls --num-lookahead-slots --max-num-partial-prefills "
            "--max-long-partial-prefills --long-prefill-token-threshold --stream-interval"),
    *_group("the KV pool is sized by --num-kv-blocks or --kv-cache-memory-bytes", _never,
            values="--num-gpu-blocks-override"),
    *_group("LoRA here: --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras (no bias, no extra vocabulary, "
            "the model dtype)", _never, values="--lora-extra-vocab-size --lora-dtype",
            switches="--enable-lora-bias --fully-sharded-loras"),
    *_group("SSL: terminate TLS in a proxy in front of pagedkv", _never,
            values="--ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers",
            switches="--enable-ssl-refresh"),
    *_group("no root path: serve under a proxy that strips the prefix", _never, values="--root-path"),
    *_group("--show-hidden-metrics-for-version: pagedkv exports its metric set, no deprecated ones", _never,
            values="--show-hidden-metrics-for-version"),
    *_group("the HTTP parser's limits here are --max-request-bytes and the connection limits", _never,
            values="--h11-max-incomplete-event-size --h11-max-header-count"),
    *_group("a Hugging Face token is read from HF_TOKEN or the hub's login", _never, values="--hf-token"),
    *_group("expert-parallel load balancing needs expert parallelism", _never,
            values="--eplb-config --num-redundant-experts --eplb-window-size --eplb-step-interval "
            "--expert-placement-strategy"),
    *_group("no gRPC or Cohere / Anthropic front-ends: pagedkv serves OpenAI's API", _never,
            values="--grpc-port --cohere-format --anthropic-disabled-thinking-effort", switches="--grpc "
            "--cohere-is-reasoning-model"),
    *_group("not implemented in pagedkv's OpenAI front-end", _never,
            values="--default-chat-template-kwargs --disable-access-log-for-endpoints --sse-keep-alive-interval "
            "--tool-strict-level --fingerprint-mode --fingerprint-value",
            switches="--enable-log-deltas --enable-offline-docs --tokens-only --return-sampling-mask "
            "--enable-return-routed-experts --enable-flash-late-interaction"),
    *_group("no per-request or extra engine metrics or histogram buckets beyond /metrics' own", _never,
            values="--custom-histogram-buckets --kv-cache-metrics-sample --per-request-spec-decode-metrics",
            switches="--enable-per-request-metrics --kv-cache-metrics --enable-logging-iteration-details"),
    *_group("the logging setup is --log-level and --log-format json", _never, values="--logging-config"),
    *_group("pagedkv's scheduler has its own limits: --max-num-seqs, --max-num-batched-tokens, --max-queue, "
            "--max-step-time-s", _never, values="--max-num-active-seqs --max-num-queued-reqs --max-num-queued-tokens "
            "--max-num-scheduled-tokens --prefill-schedule-interval --prefix-cache-retention-interval "
            "--prefix-match-unit", switches="--long-prefill-token-threshold-adaptive --scheduler-reserve-full-isl"),
    *_group("quantization here is --quantization (q8_0, a GGUF's own types); no other configuration", _never,
            values="--quantization-config --kv-cache-dtype-skip-layers", switches="--allow-deprecated-quantization"),
    *_group("speculative decoding is --speculative-config here (ngram or a draft model)", _never,
            values="--spec-method --spec-model --spec-tokens"),
    *_group("no weight offloading or transfer: weights stay where they are loaded", _never,
            values="--cpu-offload-params --offload-backend --weight-transfer-config --sleep-preserve-parameter-names"),
    *_group("no model class overrides, diffusion, engram, watermark, reasoning-budget or auxiliary-output "
            "configurations", _never, values="--model-class-overrides --diffusion-config -dc --engram-config "
            "--watermark-config --reasoning-config --aux-output-config --ec-manager-config --fault-tolerance-config"),
    *_group("LoRA here: --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras (PEFT adapters of the "
            "attention and MLP projections)", _never, values="--lora-target-modules --max-lora-cls-labels",
            switches="--enable-mixed-moe-lora-format --enable-moe-shared-loras --enable-tower-connector-lora "
            "--specialize-active-lora"),
    *_group("pagedkv does not validate VLLM_* environment variables", _always, switches="--fail-on-environ-validation"),
]}


class _VLLMFlagAction(argparse.Action):
    """A vLLM flag given: a no-op adds its warning to ``vllm_warnings``; a refused one ends the
    parse with serve's usage and a line naming the flag and why."""

    def __init__(self, option_strings: list[str], dest: str, flag: VLLMFlag, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0 if flag.switch else None, default=None,
                         help=argparse.SUPPRESS, **kwargs)
        self.flag = flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = self.flag
        value = not (option_string or "").startswith("--no-") if flag.switch else values
        shown = option_string if flag.switch else f"{option_string} {values}"
        if not flag.harmless(value, namespace):
            parser.error(f"{shown} is not supported: {flag.why}")
        setattr(namespace, self.dest, value)
        warnings = getattr(namespace, "vllm_warnings", None) or []
        namespace.vllm_warnings = [*warnings, f"{shown} is accepted and has no effect: {flag.why}"]


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags of :data:`FLAGS` that ``serve``'s parser lacks, hidden from ``--help`` (their
    list and reasons: docs/serving.md). A no-op's warning lands in ``args.vllm_warnings``."""
    taken = {s for a in p._actions for s in a.option_strings}
    p.set_defaults(vllm_warnings=[])
    for flag in FLAGS.values():
        if flag.name in taken:
            continue
        names = [flag.name]
        if flag.switch and flag.name.startswith("--") and not flag.name.startswith("--no-"):
            names.append(f"--no-{flag.name[2:]}")
        p.add_argument(*names, dest=flag.dest, action=_VLLMFlagAction, flag=flag)
    for alias, name in ALIASES.items():  # vLLM's short spellings of flags pagedkv has
        action = p._option_string_actions.get(name)
        if action is not None and alias not in p._option_string_actions:
            cast(list[str], action.option_strings).append(alias)  # typed a Sequence; argparse keeps a list
            p._option_string_actions[alias] = action


def model_context_length(engine: LLMEngine) -> int | None:
    """The model's own context length (its config's max_position_embeddings)."""
    return engine.model_context_length


def check_max_model_len(requested: int | None, model_len: int | None) -> None:
    """vLLM's rule: a --max-model-len longer than the model's context (max_position_embeddings) is
    refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: positions past it were never trained, and
    RoPE models produce garbage there. Raises ValueError saying so."""
    if requested is None or model_len is None or requested <= model_len:
        return
    if envs.ALLOW_LONG_MAX_MODEL_LEN.get():
        return
    raise ValueError(f"--max-model-len {requested} is greater than the model's own context length "
                     f"(max_position_embeddings={model_len}): positions beyond it were never trained and give "
                     f"garbage. Give --max-model-len {model_len} or less, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                     f"to force it (with extreme caution, as vLLM says)")


def generation_overrides(override_json: str | None, max_tokens_default: int | None) -> dict[str, Any]:
    """Sampling defaults from vLLM's ``--override-generation-config`` (generation_config.json's
    names: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) and
    ``--max-tokens-default`` (the same as max_new_tokens, which it overrides), by SamplingParams'
    names. They apply to what a request leaves out: a chat without max_tokens stops after
    max_new_tokens tokens instead of at the end of the context. Raises ValueError naming the flag."""
    from pagedkv.sampling_params import GENERATION_DEFAULT_KEYS, SamplingParams

    out: dict[str, Any] = {}
    if override_json is not None:
        try:
            given = json.loads(override_json)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config: not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("--override-generation-config: give a JSON object, e.g. '{\"max_new_tokens\": 512}'")
        names = {**GENERATION_DEFAULT_KEYS, **{v: v for v in GENERATION_DEFAULT_KEYS.values()}}
        for key, value in given.items():
            if key not in names:
                raise ValueError(f"--override-generation-config: unknown key {key!r} (known: "
                                 f"{', '.join(sorted(GENERATION_DEFAULT_KEYS))})")
            out[names[key]] = value
    if max_tokens_default is not None:
        out["max_tokens"] = max_tokens_default
    for name, value in out.items():
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as exc:
            flag = "--max-tokens-default" if name == "max_tokens" and max_tokens_default is not None \
                else "--override-generation-config"
            raise ValueError(f"{flag}: {name}={value!r}: {exc}") from None
    return out
