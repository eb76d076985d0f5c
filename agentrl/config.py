"""The recipe schema: one strict pydantic model per section, and RecipeConfig holding them all.

Every field has a default and a one-line description (the README's recipe reference is generated
from them). Unknown keys are forbidden, so a misspelt one is an error naming its dotted path;
recipe.py reads a file and its overrides into this schema.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def value_types(annotation: Any) -> tuple[set[Any], bool]:
    """The types a field's annotation takes and whether it takes null: `int | None` → ({int}, True)."""
    if annotation is None:
        return set(), False
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    # `PathText | None` keeps its Annotated member, whose type is the first argument
    kinds = {get_args(a)[0] if get_origin(a) is Annotated else a for a in args if a is not type(None)}
    return kinds, type(None) in args


# A timeout: above 0, and at most a year. Beyond that a value only overflows where it is used
# (`timedelta(seconds=1e14)` in the ranks' process-group set-up, a thread's `wait`), deep in a run.
MAX_TIMEOUT_S = 365 * 24 * 3600
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]

# Operands longer than this make answers past the calculator's magnitude limit (1e100: a × b + c,
# with c up to a × b / 2, passed it at 50 digits) and, further on, its 500-character limit.
MAX_DIGITS = 49


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # no lr=inf

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for a number field; a boolean there is a mistake, not a number
        kinds, _ = value_types(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError("expected a number, not a boolean")
        return value


def _check_device(device: str) -> str:
    # torch's own spelling: no leading zero ('cuda:01'), ASCII digits only ('\d' takes '١')
    if not re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]*))?", device):
        raise ValueError("expected 'cpu', 'cuda' or 'cuda:N'")
    return device


Device = Annotated[str, AfterValidator(_check_device)]


def _home(path: str) -> str:
    """`~` expanded, as a shell would have done on a command line: a recipe or an override that
    names `~/runs/x` must not write to a directory called `~` under the working directory. A NUL
    byte names no file: refused here rather than when the run first opens the path."""
    if "\0" in path:
        raise ValueError("a path cannot contain a NUL byte")
    return os.path.expanduser(path)


PathText = Annotated[str, AfterValidator(_home)]  # a file or directory (or a name that is not one)


class LoraSettings(_Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight (full fine-tuning).")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (null: 2 × rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | str = Field("all-linear", description="Layers to adapt: module names, or "
                                                                      "'all-linear' (every linear but the head).")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _modules(cls, value: Any) -> Any:
        # Checked here so the error names the key alone, not pydantic's union branch (`.list[str]`).
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list) and names and all(isinstance(v, str) and v.strip() for v in names):
            return value
        raise ValueError("expected a non-empty list of module names or one name such as 'all-linear'")


Dtype = Literal["auto", "float32", "bfloat16"]
DTYPE_AUTO = ("'auto': bfloat16 where the hardware computes in it faster (a CUDA device with bf16, or a CPU "
              "with AMX or AVX512-BF16 that wins a start-up matmul probe), else float32.")


def _read_bf16_autocast(data: Any, section: str) -> Any:
    """Recipes written before `dtype` existed said `bf16_autocast: true/false`; read it as dtype."""
    if isinstance(data, dict) and "bf16_autocast" in data:
        data = dict(data)
        old = data.pop("bf16_autocast")
        if "dtype" in data:
            raise ValueError(f"{section}.bf16_autocast and {section}.dtype are both set; keep only dtype")
        if not isinstance(old, bool):
            raise ValueError(f"{section}.bf16_autocast: expected true or false (got {old!r}); "
                             f"{section}.dtype replaces it")
        data["dtype"] = "bfloat16" if old else "float32"
    return data


class ModelConfig(_Section):
    path: PathText = Field("smollm2-135m-instruct", description="Local model directory, hub id, or builtin name.")
    dtype: Dtype = Field("auto", description="Weight dtype of the engine's model. " + DTYPE_AUTO)
    chat_template: PathText | None = Field(
        None, description="'hermes', a Jinja file, or null for the model's own (hermes if it ignores tools).")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapters (SFT and RL).")


class ArithmeticConfig(_Section):
    min_digits: int = Field(3, ge=1, le=MAX_DIGITS, description="Fewest digits of a generated operand.")
    max_digits: int = Field(4, ge=1, le=MAX_DIGITS, description="Most digits of a generated operand.")


class DataConfig(_Section):
    source: str = Field("arithmetic", description="'arithmetic' (generated), 'files', or a hub dataset id.")
    files: list[PathText] = Field(default_factory=list, description="jsonl/json/parquet/csv files when source is 'files'.")
    split: str = Field("train", description="Split of a hub dataset.")
    prompt_key: str = Field("question", description="Column holding the user prompt.")
    answer_key: str | None = Field("answer", description="Column holding the ground truth (null: none).")
    id_key: str | None = Field(None, description="Column holding a task id (null: row index).")
    num_tasks: int = Field(8, ge=1, description="How many tasks a rollout uses.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the arithmetic generator.")
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig, description="Generator settings.")


class RolloutConfig(_Section):
    tool_configs: list[PathText] = Field(default_factory=list, description="Tool YAML files (tool_configs/*.yaml).")
    interaction_config: PathText | None = Field(None, description="Interaction YAML file, or null for none.")
    parser: Literal["hermes"] = Field("hermes", description="Function-call format the model emits.")
    system_prompt: str | None = Field(None, description="System message placed before each task's prompt "
                                                        "(a task given as messages with its own system message "
                                                        "keeps that one).")
    group_size: int = Field(4, ge=1, description="Episodes sampled per task (a GRPO group).")
    max_concurrent_episodes: int = Field(64, ge=1, description="Episodes in flight at once.")
    max_turns: int = Field(4, ge=1, description="Assistant turns per episode.")
    max_tool_calls_per_turn: int = Field(4, ge=1, description="Calls run per turn; extra calls get an error.")
    tool_timeout_s: Seconds = Field(10.0, description="Seconds a tool call may take.")
    parallel_tool_calls: bool = Field(True, description="A turn's tool calls run at once; false runs them one "
                                                        "after another in the order written, for tools whose "
                                                        "state one call changes for the next.")
    interaction_timeout_s: Seconds = Field(
        60.0, description="Seconds one call into the interaction (start, respond, finish) may take; "
                          "past it the episode fails (finish: error) and the run goes on.")
    max_tool_output_tokens: int = Field(256, ge=8, description="Tool output beyond this is cut, with a marker.")
    max_interaction_tokens: int = Field(1024, ge=8, description="An interaction's reply (a simulated user's "
                                                                "turn) beyond this is cut, with a marker.")
    max_context_tokens: int = Field(2048, ge=16, description="Prompt plus every turn, in tokens.")
    max_new_tokens_per_turn: int = Field(256, ge=1, description="Tokens one assistant turn may sample.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass. In training, below 1 the update "
                                                      "treats nucleus samples as the whole distribution's (a "
                                                      "biased gradient; a warning says so).")
    agent: str | None = Field(None, description="Agent function 'module:attr' run against the OpenAI-compatible "
                                                "endpoint instead of the builtin loop (null: builtin).")
    agent_timeout_s: Seconds = Field(
        1800.0, description="Seconds one episode of the agent function may take, its requests to the "
                            "engine included; past it the episode fails (finish: error) and the run goes on.")


class SGLangConfig(_Section):
    mode: Literal["in_process", "server"] = Field(
        "in_process", description="'in_process' (sglang.Engine, weights passed as tensors) or 'server' (HTTP).")
    url: str | None = Field(None, description="Server mode: a running server's URL (null: launch one on 127.0.0.1).")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs of the engine (a server given by URL: its own count).")
    mem_fraction: float = Field(0.5, gt=0, lt=1, description="Share of GPU memory for weights and KV cache.")
    max_total_tokens: int | None = Field(None, ge=64, description="KV-cache size in tokens (null: from mem_fraction).")
    attention_backend: str | None = Field(
        None, description="SGLang attention kernels (null: SGLang's choice on GPU, torch_native on CPU).")
    update_bucket_bytes: int = Field(512 * 2**20, ge=2**20, description="Bytes of weights sent per update call.")
    timeout_s: Seconds = Field(600.0, description="Server mode: seconds a request, or a launch, may take.")
    extra_args: dict[str, Any] = Field(default_factory=dict,
                                       description="Further SGLang server arguments, e.g. {context_length: 4096}.")


class EngineConfig(_Section):
    name: Literal["hf", "sglang"] = Field("hf", description="Inference engine: 'hf' (transformers) or 'sglang'.")
    device: Device = Field("cpu", description="Torch device of the engine.")
    max_batch_size: int = Field(64, ge=1, description="Generate calls decoded together (hf).")
    seed: int = Field(0, ge=0, lt=2**63, description="Sampling seed: each episode's seed is drawn from it (replica r: `engine.seed + r`).")
    kv_cache_bytes: int = Field(2 * 1024**3, ge=0, description="Memory for keys and values kept between an "
                                "episode's turns, so a turn prefills only its new tokens, and for prompts' "
                                "first messages shared across tasks; least recently used entries are evicted "
                                "beyond it (0: off).")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="SGLang settings (name 'sglang').")


class RewardConfig(_Section):
    function: str | None = Field("agentrl.env.rewards:gsm8k_reward",
                                 description="Outcome reward 'module:attr' (task, messages) -> float, or null.")
    tool_step_rewards: bool = Field(False, description="Add the tools' per-call rewards.")
    tool_final_rewards: bool = Field(False, description="Add each tool's end-of-episode reward.")
    interaction_scores: bool = Field(False, description="Add the interaction's scores.")
    timeout_s: Seconds = Field(60.0, description="Seconds the reward function may take for one episode (it "
                                                 "runs on a worker thread, several episodes' at once); past "
                                                 "it the episode fails (finish: error) and the run goes on.")


class SFTConfig(_Section):
    base_model: PathText | None = Field(None, description="Model the SFT stage starts from (null: model.path).")
    output: PathText | None = Field(None, description="Where the SFT model is saved (default <output_dir>/sft).")
    data: PathText = Field("arithmetic", description="'arithmetic' (generated calculator demonstrations) or a jsonl "
                                                "file with a 'messages' list per line.")
    num_examples: int = Field(32, ge=1, description="Generated demonstrations (data 'arithmetic').")
    min_digits: int = Field(2, ge=1, le=MAX_DIGITS, description="Fewest digits of a demonstration operand.")
    max_digits: int = Field(3, ge=1, le=MAX_DIGITS, description="Most digits of a demonstration operand.")
    steps: int = Field(20, ge=0, description="Optimizer steps.")
    batch_size: int = Field(4, ge=1, description="Conversations per step.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    dtype: Dtype = Field("auto", description="Compute dtype of forward passes: bfloat16 runs them under autocast, "
                                             "weights stay float32. " + DTYPE_AUTO)
    seed: int = Field(1000, ge=0, lt=2**63, description="Seed of demonstrations and batch order.")

    @model_validator(mode="before")
    @classmethod
    def _old_autocast_key(cls, data: Any) -> Any:
        return _read_bf16_autocast(data, "sft")


class AlgorithmConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = Field(
        "grpo", description="Advantage estimator: group-relative over each task's episodes, or 'gae' "
                            "with a critic (PPO).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per trainable token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token losses become one number.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below 1: ratios are held at "
                                                           "1 - clip_low or above, so it must be below 1 (1 or "
                                                           "more would clip nothing).")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1 (DAPO clip-higher: larger).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip bound for negative advantages (null: off).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference model (0: no reference).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator (Schulman's k1, k2, k3). In the loss, k2 or k3, which pull differently: "
                          "on the policy's own samples k2's gradient is that of KL(policy || reference), k3's "
                          "(GRPO's choice) that of KL(reference || policy). k1's gradient there is zero in "
                          "expectation, so it is refused unless kl_in_reward.")
    kl_in_reward: bool = Field(False, description="Apply the KL as a per-token reward penalty, not a loss term.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    rollout_is_cap: float | None = Field(
        None, ge=1, description="Truncated importance sampling (Yao et al. 2025): each trained token's policy "
                                "loss is weighted by min(p_trainer / p_engine, cap), the trainer's pre-update "
                                "probability of the sampled token over the engine's. It corrects for an engine "
                                "that samples from slightly other numbers than the trainer computes (bfloat16, "
                                "SGLang's kernels); null: off. 2 is a common cap.")


class TrainerConfig(_Section):
    steps: int = Field(10, ge=1, description="RL steps (collect, update, sync).")
    tasks_per_step: int = Field(8, ge=1, description="Tasks per step; each yields rollout.group_size episodes.")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up over the first RL steps: "
                                                   "every optimizer step of RL step k (from 0) uses "
                                                   "lr × (k + 1) / warmup_steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass.")
    micro_batch_tokens: int = Field(4096, ge=64, description="Padded tokens per forward/backward.")
    dtype: Dtype = Field("auto", description="Compute dtype of training forward passes: bfloat16 runs them under "
                                             "autocast, weights and optimizer state stay float32. " + DTYPE_AUTO)
    activation_checkpointing: bool = Field(False, description="Recompute decoder activations in the backward "
                                                            "pass: less memory per token, more compute.")
    device: Device = Field("cpu", description="Torch device of the policy, reference and critic models, "
                                                 "and of `agentrl sft`.")
    save_every: int = Field(0, ge=0, description="Every N steps save step_N/ (a model directory) and checkpoint/ "
                                                 "(resumable state); 0: only final/ at the end.")
    resume: Literal["never", "auto"] = Field(
        "never", description="'auto': continue from the newest complete checkpoint in <output_dir>/checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Resumable checkpoints kept; older ones are deleted.")
    backend: Literal["local", "ray"] = Field("local", description="'local': every role in this process; 'ray': "
                                                                  "the same workers as Ray actors.")
    world_size: int = Field(1, ge=1, description="Data-parallel ranks of the policy, reference and critic "
                                                 "(FSDP2; backend 'ray' when above 1).")
    engine_replicas: int = Field(1, ge=1, description="Rollout engines; each serves whole groups of episodes.")
    placement: Literal["colocated", "split"] = Field(
        "colocated", description="'colocated': engines share the training ranks' resources (memory released "
                                 "while training); 'split': engines get their own.")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs of each placement bundle (one per rank or "
                                                         "replica); also its torch threads.")
    ray_address: str | None = Field(None, description="Join this Ray cluster (multi-node); null: start a local "
                                                      "Ray for the run.")
    sync_bucket_mb: int = Field(256, ge=1, description="Weight-sync bucket size sent to the engines, in MiB.")
    collective_timeout_s: Seconds = Field(600.0, description="Timeout of each collective between ranks.")
    call_timeout_s: Seconds = Field(7200.0, description="Longest a worker may take to answer one call "
                                                        "(a rollout, an update) before the run stops.")

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_from_bool(cls, value: Any) -> Any:
        return ("auto" if value else "never") if isinstance(value, bool) else value
    wandb_project: str | None = Field(None, description="Also log to this Weights & Biases project (needs the "
                                                        "wandb package).")
    max_failed_fraction: float = Field(0.25, ge=0, le=1, description="Stop the run when more than this share of a "
                                                                     "step's episodes fail (engine, reward or "
                                                                     "interaction errors); rollout and eval exit "
                                                                     "with status 1 past it, results written.")

    @model_validator(mode="before")
    @classmethod
    def _old_autocast_key(cls, data: Any) -> Any:
        return _read_bf16_autocast(data, "trainer")


class CriticConfig(_Section):
    path: PathText | None = Field(None, description="Critic start point: a saved critic or causal LM "
                                               "(null: a copy of the policy's transformer, zero value head).")
    lr: float = Field(1e-5, gt=0, description="Critic AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Critic AdamW weight decay.")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clip around the old values (null: off).")


class EvalConfig(_Section):
    num_tasks: int = Field(32, ge=1, description="Held-out tasks.")
    seed: int = Field(10_000, ge=0, lt=2**63,
                      description="Seed of held-out arithmetic tasks (data.source 'arithmetic'); not data.seed.")
    files: list[PathText] = Field(default_factory=list,
                                  description="Held-out task files (other sources); none of data.files.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature for evaluation (0: greedy).")


class RecipeConfig(_Section):
    name: str = Field("run", description="Run name; names the output directory.")
    output_dir: PathText | None = Field(None, description="Where outputs go (default runs/<name>).")
    seed: int = Field(0, ge=0, lt=2**63, description="Global seed.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Where tasks come from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="The episode loop.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The inference engine.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How rewards are summed.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm-up (agentrl sft).")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL objective.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="RL optimisation.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (algorithm.advantage 'gae').")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation (agentrl eval).")

    @model_validator(mode="after")
    def _derive(self) -> "RecipeConfig":
        if self.output_dir is None:
            name = self.name  # runs/<name> must stay a run of its own under runs/
            if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
                raise ValueError(f"name {name!r} names the output directory runs/<name> (output_dir unset), so it "
                                 "must be one directory name (no '/' or NUL byte, not empty, '.' or '..')")
            self.output_dir = str(Path("runs") / self.name)
        # Both keys in full: the message names whichever an override set (recipe.named_in).
        a = self.data.arithmetic
        if a.min_digits > a.max_digits:
            raise ValueError(f"data.arithmetic.min_digits ({a.min_digits}) is larger than data.arithmetic.max_digits "
                             f"({a.max_digits})")
        if self.sft.min_digits > self.sft.max_digits:
            raise ValueError(f"sft.min_digits ({self.sft.min_digits}) is larger than sft.max_digits "
                             f"({self.sft.max_digits})")
        if self.data.files and self.data.source != "files":
            raise ValueError(f"data.files lists files, but data.source is '{self.data.source}', which does not read "
                             "them: set data.source: files")
        last_seed = self.engine.seed + self.trainer.engine_replicas - 1  # replica r samples with seed + r
        if self.engine.name == "sglang" and last_seed >= 2**32:  # it would fail in SGLang's scheduler
            raise ValueError(f"engine.seed {self.engine.seed} is too large for SGLang, which seeds NumPy with it "
                             f"(+ r for engine replica r): engine.seed + trainer.engine_replicas - 1 must be below "
                             f"2**32 (4294967296)")
        if self.sft.base_model is None:
            self.sft.base_model = self.model.path
        if self.sft.output is None:
            self.sft.output = str(Path(self.output_dir) / "sft")
        return self
