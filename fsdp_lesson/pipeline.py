"""Pipeline parallelism: P stages of consecutive layers, and micro-batches flowing through them.

    stages(model, P)       which blocks each stage holds (the C program's placement at P = 3)
    Stage                  one stage's part of the model: all a strategy and the loop read of it
    schedule_ops           the order of one stage's forwards ("F", m) and backwards ("B", m)
    pipeline_step          one training step of one stage: its ops, sends, receives and update
    pipeline_forward, ...  evaluation and sampling: logits on the last stage, told to every stage
    unit_time_records, chart, bubble   the schedules in unit time, drawn; a step's idle fraction

Forward, stage s receives its input (B/M rows of activations) from stage s - 1 and sends its
output to stage s + 1; backward, the gradients go the other way. The last stage computes the
loss. Along the data-parallel dimension each stage is trained by --strategy over the ranks that
hold the same stage (mesh.dp), unchanged: a Stage is a model to it. The M micro-batches are
gradient accumulation's (the strategy is built with accum=M): each backward adds to the
gradients, the strategy reduces as --accum-reduce says, and the update comes once per step.
The planner predicts a stage's ledger by running pipeline_step itself, dry (dryrun.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from time import perf_counter

import numpy as np

from .comm import Comm, gather_objects
from .config import SCHEDULES, ConfigError
from .memory import Activations
from .model import Model, Params, softmax
from .passes import backward, forward
from .requests import Sending
from .rng import Rng
from .strategies.base import Strategy

Op = tuple[str, int]  # ("F" or "B", micro-batch)
Record = list[tuple[int, str, float, float]]  # (micro-batch, "F" or "B", start, end) per op


def stages(model: Model, P: int) -> list[list[list]]:
    """Each stage's blocks (a layer with parameters and the ReLU after it), consecutive and by
    count: n blocks over P stages, the first n % P stages one block more. The C program's model
    at P = 3: [emb], [fc1, relu1], [fc2] (+ the loss on the last); at P = 2: [emb, fc1, relu1],
    [fc2]; with --layers 2 at P = 2: [emb, fc1, relu1], [fc2, relu2, fc3]."""
    blocks = model.blocks
    if not 1 <= P <= len(blocks):
        names = ", ".join(block[0].name for block in blocks)
        raise ConfigError(
            f"--pp {P}: the model has {len(blocks)} blocks ({names}) and every stage needs one"
            f" at least: use --pp {len(blocks)} or less, or a deeper model (--layers)"
        )
    size, extra = divmod(len(blocks), P)
    placed, start = [], 0
    for s in range(P):
        stop = start + size + (s < extra)
        placed.append(blocks[start:stop])
        start = stop
    return placed


class Stage:
    """Stage `index` of P: what a strategy and the loop read of a model (layers, blocks,
    block_inputs, config, loss), holding only this stage's layers, and the widths it receives
    (in_width; 0 on the first stage, which reads tokens) and sends on (out_width). `pp`: the
    pipeline ranks' Comm it trains over (train.run's mesh.pp), for whoever runs it."""

    def __init__(self, model: Model, P: int, index: int, pp: Comm | None = None) -> None:
        self.model, self.index, self.count, self.pp = model, index, P, pp
        self.blocks = stages(model, P)[index]
        self.layers = [layer for block in self.blocks for layer in block]
        self.block_inputs = {block[0].name for block in self.blocks}
        self.config, self.loss, self.targets = model.config, model.loss, model.targets
        widths = [0]  # widths[i]: the features layer i of the model receives (tokens: 0)
        for layer in model.layers:
            widths.append(layer.out_width(widths[-1], model.config.seq_len))
        first = model.layers.index(self.layers[0])
        self.in_width, self.out_width = widths[first], widths[first + len(self.layers)]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def init_layers(self, rng: Rng, dtype=np.float32) -> Iterator[tuple[object, Params]]:
        """The model's init_layers, every layer drawn (the random stream of single-rank
        training), this stage's yielded: the others' values are dropped one layer at a time."""
        names = {layer.name for layer in self.layers}
        for layer, params in self.model.init_layers(rng, dtype):
            if layer.name in names:
                yield layer, params


def schedule_ops(schedule: str, P: int, stage: int, M: int) -> list[Op]:
    """One stage's forwards ("F", m) and backwards ("B", m) in order:

    gpipe  every forward, then every backward: M micro-batches' activations held at once
    1f1b   P - stage - 1 forwards to fill the pipeline (warm-up), then one forward and one
           backward in turn (steady state), then the backwards left (cool-down): at most
           P - stage held (PipeDream-Flush, the 1F1B of Megatron-LM and picotron)

    With one stage both are gradient accumulation's order, train.train_step's: each micro-batch's
    forward, then its backward (no other stage waits, so nothing is gained by holding more).
    """
    if schedule == "gpipe" and P > 1:
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warmup = min(P - stage - 1, M)
    ops = [("F", m) for m in range(warmup)]
    for m in range(M - warmup):
        ops += [("F", warmup + m), ("B", m)]
    return ops + [("B", m) for m in range(M - warmup, M)]


class StageStep:
    """One step of one stage: each micro-batch's activations from its forward to its backward,
    and the sends in flight. A send is waited for once the next op's input has arrived (at once
    if it receives nothing): neighbours that send to each other then both reach their receive."""

    def __init__(
        self,
        stage: Stage,
        strategy: Strategy,
        pp: Comm,
        X: np.ndarray,
        Y: np.ndarray,
        M: int,
        record: Record | None,
        recompute: bool = False,
    ) -> None:
        self.stage, self.strategy, self.pp, self.ledger = stage, strategy, pp, strategy.ledger
        self.recompute = recompute  # keep each block's input only; backward recomputes the rest
        self.xs, self.ys = np.split(X, M), np.split(Y, M)  # (B/M, seq_len), (B/M,) each
        self.rows = len(Y)  # the loss is the mean over all the step's rows, as train_step's
        self.acts: dict[int, Activations] = {}  # micro-batch -> what its backward needs
        self.sending: list[tuple[Sending, Callable[[], None]]] = []  # (send, free its buffer)
        self.losses: list[float] = []
        self.record, self.t0 = record, perf_counter()

    def receive(self, width: int, m: int, source: int, what: str) -> np.ndarray:
        """Micro-batch m's (B/M, width) activations or gradients from `source`; then the sends
        before it are done."""
        buf = np.empty((len(self.ys[m]), width), dtype=np.float32)
        self.pp.recv(buf, source, f"{what} m{m}")
        self.finish_sends()
        return buf

    def send(self, buf: np.ndarray, to: int, tag: str, free: Callable[[], None]) -> None:
        self.sending.append((self.pp.send(buf, to, tag), free))

    def finish_sends(self) -> None:
        for sending, free in self.sending:
            sending.wait()
            free()
        self.sending = []

    def forward(self, m: int) -> None:
        """Micro-batch m through this stage's layers, what backward needs kept; the output sent
        on, or on the last stage the loss and its gradient (kept for the backward)."""
        stage, pp = self.stage, self.pp
        if stage.is_first:
            x = self.xs[m]  # (B/M, seq_len) tokens
            self.finish_sends()
        else:
            x = self.receive(stage.in_width, m, pp.rank - 1, "act")  # (B/M, in_width)
        start, acts = perf_counter(), Activations(self.ledger, prefix=self.label(m))
        self.acts[m] = acts
        x = forward(stage, self.strategy, x, acts, self.recompute)
        if stage.is_last:  # x: the logits (B/M, V); their gradient waits in acts for backward
            loss, cache = stage.loss.forward(x, self.ys[m])
            acts.gradient("dlogits", stage.loss.backward(cache, rows=self.rows))
            self.losses.append(loss)
        else:  # x: (B/M, out_width), counted until the send is done
            label = f"m{m} sent"
            self.ledger.hold("activations", label, x.nbytes)
            self.send(x, pp.rank + 1, f"act m{m}", lambda: self.ledger.free(label))
        self.note(m, "F", start)

    def backward(self, m: int) -> None:
        """Micro-batch m's backward through this stage, its gradients added to the strategy's;
        the gradient of the stage's input sent back (none on the first stage: tokens)."""
        stage, pp, acts = self.stage, self.pp, self.acts.pop(m)
        if stage.is_last:  # acts holds the loss's gradient (B/M, V)
            self.finish_sends()
        else:
            acts.gradient("d_out", self.receive(stage.out_width, m, pp.rank + 1, "grad"))
        start = perf_counter()
        self.strategy.begin_micro_batch(m)  # the first backward writes the gradients, later add
        backward(stage, self.strategy, acts, self.recompute)
        if stage.is_first:
            acts.clear()
        else:  # acts.grad: (B/M, in_width), counted until the send is done
            self.send(acts.grad, pp.rank - 1, f"grad m{m}", acts.clear)
        self.note(m, "B", start)

    def label(self, m: int) -> str:
        """Micro-batch m's prefix in the ledger's labels (none with one stage, as train_step)."""
        return f"m{m} " if self.pp.size > 1 else ""

    def note(self, m: int, kind: str, start: float) -> None:
        """Add the op's compute span (from its input's arrival) to the record, if one is kept."""
        if self.record is not None:
            self.record.append((m, kind, start - self.t0, perf_counter() - self.t0))


def check_pipeline(
    stage: Stage, strategy: Strategy, pp: Comm, M: int, schedule: str, rows: int
) -> None:
    """Refuse a pipeline step whose pieces do not fit together, saying how to build them."""
    if (pp.size, pp.rank) != (stage.count, stage.index):
        raise ConfigError(
            f"stage {stage.index} of {stage.count} runs on rank {pp.rank} of {pp.size} pipeline"
            " ranks: build it as Stage(model, mesh.pp.size, mesh.pp.rank)"
        )
    if strategy.model is not stage:
        raise ConfigError("the strategy trains another model: build it with this Stage as model")
    if strategy.accum != M:
        raise ConfigError(
            f"the strategy accumulates over {strategy.accum} micro-batches, the pipeline runs {M}:"
            f" build the strategy with accum={M} (a pipeline's micro-batches are accumulation's)"
        )
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if rows % M:
        raise ConfigError(f"{rows} rows do not split into {M} micro-batches: use a divisor")


def pipeline_step(
    stage: Stage,
    strategy: Strategy,
    pp: Comm,
    X: np.ndarray,
    Y: np.ndarray,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    record: Record | None = None,
    recompute: bool = False,
) -> float:
    """One training step of this stage on this rank's rows X (B, seq_len), Y (B,): the
    schedule's forwards and backwards of M micro-batches, then the strategy's update. Returns
    this rank's loss (the mean over its B rows, computed on the last stage) on every stage.
    With `record`, each op's (micro-batch, "F"/"B", start, end) in seconds from the step's start;
    with recompute, each micro-batch keeps only its blocks' inputs until its backward."""
    check_pipeline(stage, strategy, pp, micro_batches, schedule, len(Y))
    step = StageStep(stage, strategy, pp, X, Y, micro_batches, record, recompute)
    for kind, m in schedule_ops(schedule, pp.size, pp.rank, micro_batches):
        step.forward(m) if kind == "F" else step.backward(m)
    step.finish_sends()
    strategy.begin_phase("update")
    strategy.step()
    return from_last_stage(pp, sum(step.losses) / micro_batches if stage.is_last else 0.0)


def from_last_stage(pp: Comm, value: float) -> float:
    """The last stage's value on every stage (a float64 broadcast over pp; one stage: itself)."""
    if pp.size == 1:
        return value
    buf = np.array([value], dtype=np.float64)
    return float(pp.bcast(buf, root=pp.size - 1)[0])


# --- evaluation and sampling: the logits reach the last stage, the answer every stage --------


def pipeline_forward(stage: Stage, strategy: Strategy, pp: Comm, x: np.ndarray):
    """The logits (rows, V) of tokens x (rows, seq_len) on the last stage, None on the others
    (every stage is given x; the first reads it). Nothing is kept for a backward."""
    if not stage.is_first:
        x = pp.recv(np.empty((len(x), stage.in_width), np.float32), pp.rank - 1, "act")
    x = forward(stage, strategy, x)
    if stage.is_last:
        return x
    pp.send(x, pp.rank + 1, "act").wait()
    return None


def pipeline_loss(stage: Stage, strategy: Strategy, pp: Comm, x: np.ndarray, y: np.ndarray):
    """The mean loss of rows x, y (the last stage's) on every stage: evaluation's."""
    logits = pipeline_forward(stage, strategy, pp, x)
    return from_last_stage(pp, stage.loss.forward(logits, y)[0] if stage.is_last else 0.0)


def pipeline_next_token(
    stage: Stage, strategy: Strategy, pp: Comm, context: np.ndarray, u: float
) -> int:
    """The token sampling draws after context (1, seq_len) with u in [0, 1), as
    train.sample_name chooses it, chosen on the last stage and broadcast to every stage."""
    logits = pipeline_forward(stage, strategy, pp, context)
    token = np.zeros(1, dtype=np.int32)
    if logits is not None:  # walk the probabilities with a running float32 sum: the first >= u
        probs = softmax(stage.loss.next_token_logits(logits))[0]
        token[0] = min(np.searchsorted(np.cumsum(probs), u), len(probs) - 1)
    return int(token[0] if pp.size == 1 else pp.bcast(token, root=pp.size - 1)[0])


def gather_stages(stage_params: dict[str, Params], pp: Comm) -> dict[str, Params]:
    """Every stage's parameters (e.g. its strategy.full_params()) on pp rank 0, in the model's
    order; {} elsewhere. Pickled: for the end of a run, not a step."""
    parts = gather_objects(pp, stage_params)
    return {} if parts is None else {k: v for part in parts for k, v in part.items()}


# --- the schedule in pictures: unit time, and a step's idle fraction --------------------------


def unit_time_records(schedule: str, P: int, M: int, backward: int = 1) -> list[Record]:
    """Every stage's record of one step if a forward took 1 time unit, a backward `backward`
    and a message none: each op starts once its stage is free and its input exists."""
    ops = [schedule_ops(schedule, P, s, M) for s in range(P)]
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, m) -> when it ends
    records: list[Record] = [[] for _ in range(P)]
    while sum(map(len, records)) < sum(map(len, ops)):
        progress = False
        for s in range(P):
            while len(records[s]) < len(ops[s]):
                kind, m = ops[s][len(records[s])]
                needs = (s - 1, "F", m) if kind == "F" else (s + 1, "B", m)
                if s == P - 1 and kind == "B":
                    needs = (s, "F", m)  # the loss: the last stage turns forward into backward
                if needs not in done and not (s == 0 and kind == "F"):
                    break
                start = max(records[s][-1][3] if records[s] else 0, done.get(needs, 0))
                done[(s, kind, m)] = end = start + (1 if kind == "F" else backward)
                records[s].append((m, kind, start, end))
                progress = True
        if not progress:
            raise ValueError(f"{schedule}: the stages wait for each other forever")
    return records


def chart(records: list[Record]) -> str:
    """One line per stage, one column per time unit: F0 or B0 while it computes, .. idle."""
    width = max(end for record in records for *_, end in record)
    lines = []
    for s, record in enumerate(records):
        cells = [".."] * int(width)
        for m, kind, start, end in record:
            cells[int(start) : int(end)] = [f"{kind}{m}"] * int(end - start)
        lines.append(f"stage {s} | " + " ".join(cells))
    return "\n".join(lines)


def bubble(record: Record, span: float | None = None) -> float:
    """The idle fraction of one stage's step: 1 - its compute time / the step's time `span`
    (by default to its own last op's end). In unit time, with span the last stage's end,
    GPipe's and 1F1B's are (P - 1) / (M + P - 1) on every stage."""
    busy = sum(end - start for _, _, start, end in record)
    return 1 - busy / (span or max(end for *_, end in record))
