"""What a drafter family is: the one object every consumer asks instead of testing a drafter's type.

Usage:
    fam = contract.family                         # the `Family` of `contract.drafter_type` (registry: __init__)
    fam.network.build(contract, None, None)       # a new random drafter network of this family
    fam.network.reduced_vocab, fam.decoding.vllm_runner   # capabilities: a draft vocab? which vLLM runner?
    tokens, law = fam.decoding.propose(drafter, h, logits, anchor, DraftSampling(), None, vocab_size)   # a step
    tokens, law = fam.decoding.propose(..., block=DraftBlock(embed=target.embed, context=feats[:, -1]))
    terms = fam.terms(cfg.train.weights)          # its own loss terms, from its weights (train/loss.py composes them)
    knobs: DSparkKnobs = fam.own_knobs(cfg.drafter.knobs)   # its settings, typed as its own class
    fam.metric_names, fam.knob_names              # declared: by its objective and its knobs

A `Family` is a frozen record of four records (`Network`, `Objective`, `Formats`, `Decoding`) and its
declared settings (`knobs`, `weights`: `family/knobs.py`), written by one module per family and listed by the
registry (`family/__init__.py`): the pattern of torchtitan's `TrainSpec`, composition rather than a class
hierarchy. What a hook gets from a higher room is handed in (the decoder's sampling law in `DraftSampling` and
what it knows of the block in `DraftBlock`; the loss's chunk of rows in `Rows`, its blocks in `Blocks`), so
this room ranks above `model/` and below everything that asks it, the config included: the config holds a
family's settings as the family's own frozen dataclasses (`cfg.drafter.knobs`, `cfg.train.weights`), and the
hooks receive those, never a config section. What the registry's checks read of a section is declared here
(`DrafterKeys`, `TrainKeys`), so no family module imports dflashkit.config, not even for its types.

The contract (`family/contract.py`) asks the registry for its family, and through it its checks and formats,
so a family names what its hooks read of a contract here, as a Protocol (`ContractSpec`), instead of
importing the contract's class, even for its type: no module of this package imports another in a circle,
type-only imports included (tests/test_layering.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from dflashkit.errors import DflashkitError, UsageError
from dflashkit.family.knobs import NoKnobs, field_names, range_problems, type_problems
from dflashkit.model.spec import DraftSpec

if TYPE_CHECKING:
    import torch


class DrafterKeys(Protocol):
    """What the families' checks read of the `drafter.*` section (the config's `DrafterSection` is one)."""

    @property
    def type(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def hidden_size(self) -> int | None: ...

    @property
    def draft_vocab_size(self) -> int | None: ...

    @property
    def knobs(self) -> object: ...


class TrainKeys(Protocol):
    """What the families' checks read of the `train.*` section (the config's `TrainSection` is one)."""

    @property
    def loss(self) -> str: ...

    @property
    def on_path(self) -> str: ...

    @property
    def pack(self) -> bool: ...

    @property
    def weights(self) -> object: ...


class ContractSpec(DraftSpec, Protocol):
    """What the families' hooks read of a drafter contract (`family/contract.py`'s `DrafterContract` is one):
    the fields a network reads (`DraftSpec`) and the contract's family."""

    @property
    def family(self) -> Family: ...


class RunKeys(Protocol):
    """The two sections of a run config (`RunConfig`) the families' checks read."""

    @property
    def drafter(self) -> DrafterKeys: ...

    @property
    def train(self) -> TrainKeys: ...


@dataclass(frozen=True)
class DraftSampling:
    """How the decoder wants one block drafted (it ranks above this room, so it hands its sampling in).

    `temperature` 0 asks for point-mass drafts (greedy); > 0 for drafts drawn from the family's draft
    law, which the step then returns for the rejection rule. `law` turns head logits [k, V'] into the
    sampling law at the request's temperature / top-p / top-k (`decode.sampling.sampling_probs`),
    `draw` takes one token per row of a law (`decode.sampling.sample`)."""

    temperature: float = 0.0
    law: Callable[[torch.Tensor], torch.Tensor] | None = None
    draw: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    generator: Any = None


@dataclass(frozen=True)
class DraftBlock:
    """What the decoder knows about the block it drafts beside the drafter's outputs, for a head that reads it
    (LiLiCorr: the target's input embedding of its candidates and the features of the last committed token)."""

    embed: Callable[[torch.Tensor], torch.Tensor] | None = None   # the target's input embedding (ids → [..., H])
    context: torch.Tensor | None = None   # [1, n_feat·H] target features of the token before the anchor


@dataclass
class Blocks:
    """The micro-batch's blocks as a loss term that scores whole blocks reads them (`Rows.blocks`; a chunk of
    rows never splits a block). Flat row index i = (b·N + n)·B + k: block i // B, block position i % B."""

    hidden: torch.Tensor                # [b·N·B, H] drafter outputs of every block position (with grad)
    score: Callable[[torch.Tensor], torch.Tensor]   # drafter outputs [r, H] → the head's scores [r, V'] (float32)
    embed: Callable[[torch.Tensor], torch.Tensor]   # the target's input embedding
    features: torch.Tensor | None       # [b, S, n_feat·H] the context features (None: no context, ablated)
    anchors: torch.Tensor               # [b, N] anchor positions
    block_size: int
    # [b·N·B] bool: positions supervised before `train.on_path=mask` drops the off-path ones (None: the rows are
    # all of them). A term that needs whole blocks asks this, not the rows, whether a block is complete.
    supervised: torch.Tensor | None = None


@dataclass
class Rows:
    """One chunk of supervised rows of the loss, as a loss term's `chunk` sees it (inside the checkpoint)."""

    model: Any                          # the drafter (unwrapped)
    hidden: torch.Tensor                # [r, H] drafter outputs
    scores: torch.Tensor                # [r, V'] float32: the head's logits as the family scores them
    labels: torch.Tensor                # [r] labels (draft-vocab indices with a reduced vocab)
    prev: torch.Tensor | None = None    # [r] the gold token before each row (terms with `needs_prev`)
    index: torch.Tensor | None = None   # [r] flat row indices (`Blocks`), ascending
    target: torch.Tensor | None = None  # [r, V'] the target's logits predicting each row's label (KL, `needs_target`)
    blocks: Blocks | None = None        # the micro-batch's blocks

    @functools.cached_property
    def ce(self) -> torch.Tensor:
        """[r] CE(scores, label) per row, computed once per chunk (the CE term and D-PACE weights share it)."""
        import torch.nn.functional as F

        return F.cross_entropy(self.scores, self.labels, reduction="none")


@dataclass
class Scored:
    """What a loss term may re-score after the chunks (`LossTerm.rescore`): the argmax's verdicts and the
    context of every block, so a family can score what its decoder actually drafts."""

    model: Any
    hidden: torch.Tensor                # [b·N·B, H] drafter outputs (detached)
    rows: torch.Tensor                  # [r] flat indices of the supervised rows
    parts: list[Any]                    # this term's `chunk` results, chunk by chunk
    input_ids: torch.Tensor             # [b, S]
    anchors: Any                        # train.objective.Anchors
    labels: torch.Tensor                # [b, N, B] label ids (target ids)
    supervised: torch.Tensor            # [b, N, B] bool
    ok: torch.Tensor                    # [b, N, B] the argmax prediction is the label (and supervised)
    tau_sum: Callable[[torch.Tensor], float]   # Σ over real blocks of 1 + leading ok (train.loss.tau_sum)


class LossTerm(Protocol):
    """One part of the training loss; `train/terms.py` has CE and KL, a family adds its own.

    The loss builds the micro-batch's blocks once, runs the drafter once, then asks each term, in order:
      * `chunk(rows)`: its per-row values of one chunk of supervised rows (`Rows`: the drafter's outputs, the
        head's scores, the labels, and what it asked for), inside the checkpointed chunk; anything (None: none).
      * `total(parts, row_w)`: from its `chunk` results (one per chunk, in row order) and the rows' position
        weights [r], its part of Σ (weighted, before the step denominator) and its statistics (names of
        the family's `stats`).
      * `rescore(scored)`: the metrics' verdicts it replaces (None: keep the argmax's) and more statistics.
    `needs_prev` asks for the gold predecessors (`Rows.prev`), `needs_target` for the target's logits
    (`Rows.target`; the trainer then supplies them, `family.reads_target_law`)."""

    @property
    def name(self) -> str: ...

    @property
    def needs_prev(self) -> bool: ...

    @property
    def needs_target(self) -> bool: ...

    def chunk(self, rows: Rows) -> Any: ...

    def total(self, parts: list[Any], row_w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]: ...

    def rescore(self, s: Scored) -> tuple[torch.Tensor | None, dict[str, Any]]: ...


@dataclass(frozen=True)
class StatField:
    """One summable statistic a family adds to a step's (`train/stats.py`): `size` 1 or "B" (one per block
    position); a `loss` one is scaled like the loss (1/denominator in training, per Σw held out)."""

    name: str
    size: int | str = 1
    loss: bool = False


def _nothing(*_: Any, **__: Any) -> list:
    return []


def _empty(*_: Any, **__: Any) -> dict[str, Any]:
    return {}


def _same(_model: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits


def _zero(_c: Any) -> int:
    return 0


def _never(_c: Any) -> bool:
    return False


@dataclass(frozen=True)
class Network:
    """The family's network and its tensors.

    build(c, draft_vocab, feature_scale): a new random drafter (refusing a draft vocab when `reduced_vocab` is
        False: `refuse_draft_vocab`); its parameters beyond DFlash's are counted from it (`family.extra_params`).
    init_from: family name → conversion(model, state) of the checkpoints it may start from (`drafter.init`),
        besides its own; anything else is refused.
    tensor_markers: name parts of the tensors only this family's checkpoints hold.
    reduced_vocab: whether it can draft over a reduced draft vocabulary (`drafter.draft_vocab_size`).
    scores(model, logits): the head's logits as the loss and metrics score them.
    lookup_params(c): those of its parameters that are looked up rather than multiplied (`dflashkit plan`)."""

    build: Callable[..., Any]
    init_from: Mapping[str, Callable[[Any, dict], dict]] = field(default_factory=dict)
    tensor_markers: tuple[str, ...] = ()
    reduced_vocab: bool = True
    scores: Callable[[Any, torch.Tensor], torch.Tensor] = _same
    lookup_params: Callable[[ContractSpec], int] = _zero


@dataclass(frozen=True)
class Objective:
    """What the family adds to the training loss and its statistics.

    loss_terms(weights): its own loss terms (`train/loss.py` composes them with CE / KL), from its `weights`
        (an instance of `Family.weights`: `Family.terms` hands them in).
    stats: its statistics (`StatField`), filled by its terms; metrics(stats): its metrics from a step's summed
        statistics, named `metric_names` (exactly those: the step's record checks, `train/stats.py`).
    packs: its loss takes packed rows (`train.pack`: per-document anchors, positions and masks)."""

    loss_terms: Callable[[Any], list[LossTerm]] = _nothing
    stats: tuple[StatField, ...] = ()
    metrics: Callable[..., dict[str, Any]] = _empty
    metric_names: tuple[str, ...] = ()
    packs: bool = False


@dataclass(frozen=True)
class Formats:
    """How the family's checkpoints are written and read.

    architecture: config.json `architectures[0]`, the class of the shipped `dflash.py` that loads it.
    dflash_config(c) / hf_keys(c): its `dflash_config` keys and its top-level config.json keys beside them.
    read_knobs(cfg, dflash_config, source): its contract fields from a config.json (UsageError).
    speculators: vLLM's speculators reader knows it (`export.format=speculators`; else refused, exit 2);
        speculators_keys: the knobs that reader takes from the config's top level (any other that is set
        cannot travel in that format); speculators_top_keys: the top-level config.json keys (`hf_keys`) that
        format carries as they are (DSpark's `markov_rank`, `enable_confidence_head`, ...: vLLM's `dspark`
        reader copies them).
    reload_check(source, reloaded, head): the export reload check's family part.
    card_lines(c): what the model card says about serving it.
    modeling_source: Python source appended to the shipped `dflash.py` that defines `architecture` (a family
        whose class is not in `export/dflash_modeling.py`: a plugin); "" for the built-in ones."""

    architecture: str
    dflash_config: Callable[[ContractSpec], dict[str, Any]] = _empty
    hf_keys: Callable[[ContractSpec], dict[str, Any]] = _empty
    read_knobs: Callable[[dict, dict, str], dict[str, Any]] = _empty
    speculators: bool = True
    speculators_keys: tuple[str, ...] = ()
    speculators_top_keys: tuple[str, ...] = ()
    reload_check: Callable[[Any, Any, Any], dict[str, Any]] = _empty
    card_lines: Callable[[ContractSpec], list[str]] = _nothing
    modeling_source: str = ""


@dataclass(frozen=True)
class Decoding:
    """How the family drafts.

    propose(drafter, h, logits, anchor, sampling, vocab, vocab_size, block=DraftBlock): one draft step →
        (tokens, draft law [k, V] or None for point masses).
    vllm_runner: "any" or "v2" (vLLM runs it on its V2 model runner only).
    vllm_method: the `method` of vLLM's --speculative-config that serves it ("dflash"; DSpark's "dspark": with
        "dflash" vLLM reads the export as `DFlash<architecture>`, which it does not know).
    reference_loop: the z-lab PyPI loop (dflash 0.1.0) decodes it (`bench decode`'s reference).
    fast_path(c): whether `decode/fast_draft.py`'s lean forward computes the module forward of a drafter of
        contract c: plain DFlash layers (GQA attention and the SwiGLU MLP, nothing between them) and nothing
        added to the network's inputs or outputs. False (the default) keeps the module's forward.
    confidence(drafter, h, logits, anchor, tokens): each proposed token's probability of acceptance, what the
        draft-length policy (`decode/draft_length.py`) weighs against t(n) and a graft keeps a prefix by, for a
        point-mass block (`propose`'s h and head logits, its anchor and its k tokens) → k floats; None (the
        default): the softmax of the head's logits at the tokens."""

    propose: Callable[..., tuple[list[int], Any]]
    vllm_runner: str = "any"
    vllm_method: str = "dflash"
    reference_loop: bool = False
    fast_path: Callable[[ContractSpec], bool] = _never
    confidence: Callable[..., list[float]] | None = None


@dataclass(frozen=True)
class Family:
    """A drafter family: everything about it that the trainer, the decoder, the formats and the engines ask.

    name: `drafter.type`, `contract.drafter_type`; title: how messages and the docs call it.
    network, objective, formats, decoding: its records (above).
    knobs: frozen dataclass of the contract fields (and `drafter.*` keys, same names) it adds, each a
        `knobs.knob` (default, help, range); weights: the same for the `train.*` keys only its loss terms read
        (DFlash2's `selector_loss_weight`). The config holds an instance of each (`cfg.drafter.knobs`,
        `cfg.train.weights`, resolved by `drafter.type` at load); their field names are the flat YAML keys.
    config_problems(d, knobs) / contract_problems(c): its cross-field checks of the `drafter.*` keys (`knobs` its
        own knobs; each problem naming the key) and of a contract; the types and ranges of its knobs are checked
        from their declarations.
    """

    name: str
    title: str
    network: Network
    decoding: Decoding
    formats: Formats
    objective: Objective = Objective()
    knobs: type = NoKnobs
    weights: type = NoKnobs
    config_problems: Callable[[DrafterKeys, Any], list[str]] = _nothing
    contract_problems: Callable[[ContractSpec], list[str]] = _nothing

    @property
    def architecture(self) -> str:
        """config.json `architectures[0]` (`formats.architecture`): how messages name its checkpoints."""
        return self.formats.architecture

    @property
    def knob_names(self) -> tuple[str, ...]:
        """Its contract fields, in the order they are written."""
        return field_names(self.knobs)

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The `train.*` keys only its loss terms read."""
        return field_names(self.weights)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The step / held-out metrics its `objective.metrics` adds (`Objective.metric_names`)."""
        return self.objective.metric_names

    def make_knobs(self, values: Mapping[str, Any]) -> Any:
        """Its knobs from a mapping holding (some of) their names; the rest keep their defaults."""
        return self.knobs(**{k: values[k] for k in self.knob_names if k in values})

    def own_knobs(self, value: object) -> Any:
        """Its knobs from a section's (`cfg.drafter.knobs`): those themselves when they are its class, else its
        defaults with the fields it shares with them (DFlash's `causal`: a run of another family)."""
        return _own(self.knobs, value)

    def own_weights(self, value: object) -> Any:
        """Its weights from a section's (`cfg.train.weights`), as `own_knobs`."""
        return _own(self.weights, value)

    def terms(self, weights: object) -> list[LossTerm]:
        """Its own loss terms under the `train.*` weights `weights` (`cfg.train.weights`; another family's
        or none: its defaults)."""
        return self.objective.loss_terms(self.own_weights(weights))

    def contract_fields(self, d: DrafterKeys) -> dict[str, Any]:
        """The contract's family fields from `cfg.drafter` (probe, `bench recipe`'s own contracts)."""
        return {"drafter_type": self.name, "knobs": self.own_knobs(d.knobs)}

    def owns_tensor(self, name: str) -> bool:
        return any(m in name for m in self.network.tensor_markers)


def _own(cls: type, value: object) -> Any:
    if type(value) is cls:
        return value
    names = field_names(cls)
    return cls(**{k: getattr(value, k) for k in names if hasattr(value, k)})


def knob_problems(c: ContractSpec) -> list[str]:
    """The types, then (when those are right) the declared ranges of a contract's knobs: the part of every
    family's contract check that comes from the knobs' declarations."""
    return type_problems(c.knobs) or range_problems(c.knobs)


def json_int(value: Any, key: str, source: str) -> int:
    """`value` of `key` in the drafter config.json `source` as an integer: a JSON integer, never "4", 4.0 or
    true (UsageError naming `key`, exit 2)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{source}: {key} must be an integer, got {value!r} ({type(value).__name__})",
                         hint=f"fix {source}: write the number without quotes")
    return value


def json_float(value: Any, key: str, source: str) -> float:
    """`value` of `key` in the drafter config.json `source` as a float: a JSON number, never "2.0" or true
    (UsageError naming `key`, exit 2)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{source}: {key} must be a number, got {value!r} ({type(value).__name__})",
                         hint=f"fix {source}: write the number without quotes")
    return float(value)


def draft_vocab_problem(fam: Family, size: int | None, *, where: str) -> str | None:
    """THE refusal of a reduced draft vocabulary (`size` tokens) for a family that drafts over the full vocab:
    the problem naming `where` (a config key, a file), or None when the family takes one (or there is none)."""
    if fam.network.reduced_vocab or not size:
        return None
    return (f"{where}: {size} with drafter.type={fam.name}; a {fam.architecture} drafts over the full target "
            "vocabulary (vLLM indexes its tensors by target id and has no draft-to-target map for it)")


def refuse_draft_vocab(fam: Family, size: int | None, *, where: str, hint: str = "remove drafter.draft_vocab_size"
                       ) -> None:
    """Raise the `draft_vocab_problem` as a UsageError (exit 2), if there is one."""
    problem = draft_vocab_problem(fam, size, where=where)
    if problem:
        raise UsageError(problem, hint=hint)


def same_weights(source: Any, reloaded: Any) -> bool:
    """Whether `reloaded` holds `source`'s weights bit for bit (a float32 export; a reader that upcasts a bf16
    export to float32 does not make it one): then a family's reload check must find the same drafts."""
    a, b = source.state_dict(), reloaded.state_dict()
    return a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)


def walk_reload_check(source: Any, reloaded: Any, head: Any, *, title: str, walk: Callable[..., Any],
                      extra: Callable[[Any], Any] = lambda g: None, blocks: int = 3, context: int = 6) -> dict[str, Any]:
    """The export reload check of a family that drafts by a walk (DFlash2, LiLiCorr): source vs reloaded drafter
    on one fixed random input, the tokens of the greedy walk; identical when the export holds the source's
    weights bit for bit (`same_weights`: a float32 export), else only reported.

    `walk(model, h, logits, ctx, extra)` → tokens is the family's walk over block positions 1 … B−1 (h the
    drafter's output there, logits `h @ head.T`, ctx the random context features); `extra(generator)` draws
    what else the walk reads (anchors, an embedding table). `head` [V, H] is the target's head (None: a
    fixed random one, so the walk is still exercised)."""
    import torch

    c = source.contract
    g = torch.Generator().manual_seed(0)
    q = c.block_size
    noise = torch.randn(blocks, q, c.hidden_size, generator=g)
    ctx = torch.randn(blocks, context, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(context + q)[None].expand(blocks, -1)
    proj = (head if head is not None else torch.randn(c.vocab_size, c.hidden_size, generator=g)).float()
    more = extra(g)
    with torch.inference_mode():
        paths = []
        for model in (source.float(), reloaded.float()):
            h = model(noise, ctx, pos)[:, 1:]                                  # [blocks, B-1, H]
            paths.append(walk(model, h, h @ proj.T, ctx, more))
    same = (paths[0] == paths[1]).float().mean().item()
    if same_weights(source, reloaded) and same < 1.0:
        raise DflashkitError(f"export reload check failed: the reloaded {title} drafter walks another path "
                             f"({same:.0%} of the drafted tokens agree) on the same input",
                             hint="nothing was replaced; this is a bug, please report it")
    return {"walk_agreement": same, "walk_tokens": int(paths[0].numel())}


def torch_equal(x: Any, y: Any) -> bool:
    import torch

    return x.shape == y.shape and bool(torch.equal(x.detach().cpu().to(y.dtype), y.detach().cpu()))


def ratio(a: Any, b: Any) -> float | None:
    """a / b of two summed counts, rounded to 4 places (None when nothing was counted)."""
    return round(float(a / b), 4) if b > 0 else None
