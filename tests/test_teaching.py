"""docs/teaching.md against the notebooks and the checkers: one duration per notebook (the
notebook's first cell, the guide's heading and its plans agree), and the checker messages the
guide quotes are the lines the checkers print, taken from real runs of wrong answers."""

from __future__ import annotations

import importlib.util
import math
import re
import textwrap
from pathlib import Path

import nbformat
import numpy as np
import pytest
from test_exercises import (  # notebook 13's step and bytes, 14's usual wrong answers
    CABLE_BYTES,
    FAST_STEP,
    numel,
    wrong_attention,
)

from fsdp_lesson import checks
from fsdp_lesson.attention import merge
from fsdp_lesson.commbench import tcp_payload_rate
from fsdp_lesson.config import ModelConfig
from fsdp_lesson.exercises import (
    bridge,
    checkpoints,
    communication,
    context,
    data_parallel,
    dataset,
    fsdp_practice,
    many_hosts,
    memory,
    pipeline,
    single_rank,
    transformer,
    zero3,
    zero12,
)
from fsdp_lesson.flat import FlatParam
from fsdp_lesson.model import MLP
from fsdp_lesson.pipeline import schedule_ops

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "teaching.md").read_text()
NOTEBOOKS = {path.name[:2]: path for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*"))}
HEADING = re.compile(r"^### (\d\d) · .*$", re.M)
QUOTE = re.compile(r"[`\"](✗ [^`\"]+)[`\"]")  # a checker's line as the guide quotes it


def sections() -> dict[str, str]:
    """The guide's section of each notebook, by its number: heading line and body."""
    starts = list(HEADING.finditer(GUIDE))
    ends = [m.start() for m in starts[1:]] + [GUIDE.find("\n## ", starts[-1].start())]
    return {m.group(1): GUIDE[m.start() : end] for m, end in zip(starts, ends, strict=True)}


def numbers(text: str) -> list[int]:
    return [int(k) for k in re.findall(r"\d+", text)]


def guide_minutes(section: str) -> list[int]:
    """The heading's duration: '(85 min; ...' -> [85], '(two sessions, 90 + 75 min' -> [90,
    75], '(20–30 min, optional' -> [20, 30]."""
    heading = section.splitlines()[0]
    found = re.search(r"\(([^;)]*?)\bmin\b", heading)
    assert found, f"teaching.md: the heading {heading!r} states no duration: add '(N min; ...)'"
    return numbers(found.group(1))


def notebook_minutes(path: Path) -> list[int] | None:
    """The first cell's duration: 'About 75 minutes' or '**Time:** 90 + 75 minutes ...'."""
    first = nbformat.read(path, as_version=4).cells[0].source
    found = re.search(r"(?:About|\*\*Time:\*\*)\s+([\d–+ -]+?)\s*minutes", first)
    return numbers(found.group(1)) if found else None


@pytest.mark.parametrize("number", sorted(sections()))
def test_one_duration_per_notebook(number):
    section, path = sections()[number], NOTEBOOKS[number]
    heading = guide_minutes(section)
    stated = notebook_minutes(path)
    assert stated is not None, (
        f"{path.name} states no duration in its first cell: add '**Time:** N minutes' (or"
        f" 'About N minutes'), as teaching.md's heading says ({heading} minutes)"
    )
    assert stated == heading, f"{path.name} says {stated} minutes, teaching.md {heading}"
    plans = re.findall(r"Plan[^(\n]*\((\d+) min", section)  # '#### Plan (90 minutes)'
    sessions = re.findall(r"\*\*(?:Plan, )?[Ss]ession [AB] \((\d+) min", section)
    for plan in plans:
        assert int(plan) == sum(heading) or len(heading) > 1, (
            f"teaching.md {number}: a plan of {plan} minutes under a heading of {heading}"
        )
    if sessions:
        assert [int(s) for s in sessions] == heading, (
            f"teaching.md {number}: sessions of {sessions} minutes under a heading of {heading}"
        )


def checker_source() -> str:
    """The code of every notebook and of the package: where a checker's name must occur."""
    text = "\n".join(
        cell.source
        for path in NOTEBOOKS.values()
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code"
    )
    return text + "\n".join(p.read_text() for p in (ROOT / "fsdp_lesson").rglob("*.py"))


def test_every_quoted_message_names_a_checker_that_exists():
    source = checker_source()
    for number, section in sections().items():
        for quote in QUOTE.findall(section):
            name = " ".join(quote[2:].split(":")[0].split())
            if name.startswith("...") or name.startswith("claim does not hold"):
                continue
            template = re.sub(r"\d+|True|False", r"\\{[^}]*\\}", re.escape(name))  # f"K={k}"
            variable = re.sub(r"\\\([^)]*\\\)", r"\\(\\{[^}]*\\}\\)", re.escape(name))  # "({s})"
            found = re.search(template, source) or re.search(variable, source)
            assert name in source or found, (
                f"teaching.md {number} quotes {quote!r}: no checker is named {name!r}"
            )


# --- the messages, from real runs -------------------------------------------------------------


def printed(capsys, call) -> str:
    """The first ✗ line a checker prints for a wrong answer (after the ✓ of the parts that are
    right), as the guide quotes it: its hint, after ' — ', left out."""
    call()
    wrong = [line for line in capsys.readouterr().out.splitlines() if line.startswith("✗")]
    assert wrong, "the wrong answer passed"
    return wrong[0].split(" — ")[0]


def quoted(number: str) -> set[str]:
    """The checker lines the guide quotes in a notebook's section (up to a ' — ' or '...')."""
    quotes = (" ".join(q.split()) for q in QUOTE.findall(sections()[number]))  # one line each
    return {q.split(" — ")[0].removesuffix("...").rstrip(" .") for q in quotes}


def right_gather(config, n):
    return 2 * 4 * max(FlatParam(layer.shapes, n).padded_numel for layer in MLP(config).layers)


def count_params_without_biases(V, S, E, H):
    return V * E + S * E * H + H * V


def next_unit_without_ends(u, backward, count):
    return u - 1 if backward else u + 1


def smallest_n(stage, psi, gpu, rounding=math.ceil, whole_for_dp=False):
    """Exercise 07-3's key, or one of its two usual mistakes (rounding down; a finite N for dp)."""
    unsharded = {"dp": 16, "zero1": 4, "zero2": 2, "zero3": 0}[stage] * psi
    if unsharded > gpu and not whole_for_dp:
        return math.inf
    if unsharded == 16 * psi:
        return 1
    return max(1, rounding((16 * psi - unsharded) / (gpu - unsharded)))


def hiding_batch(stage, n, flops, bandwidth, element_bytes=2, zero3_collectives=3):
    """Exercise 08-2's key, with 4-byte elements or zero3's third collective forgotten."""
    k = zero3_collectives if stage == "zero3" else 2
    return k * (n - 1) / n * element_bytes * flops / (6 * bandwidth)


def ring_call_seconds_without_the_allreduce_factor(line, kind, n, calls, buffer_bytes):
    return line["alpha_s"] * (n - 1) * calls + line["beta_s_per_byte"] * (n - 1) / n * buffer_bytes


def one_report(calls=3, buffer_bytes=4000, n=4):
    """One rank's traffic report at N = n, as commbench.predict_seconds reads it."""
    return {
        kind: {
            "calls": calls,
            "buffer_bytes": buffer_bytes,
            "messages": (2 if kind == "allreduce" else 1) * (n - 1) * calls,
            "sent_bytes": (2 if kind == "allreduce" else 1) * (n - 1) / n * buffer_bytes,
        }
        for kind in communication.KINDS
    }


FC1 = FlatParam(next(layer for layer in MLP(ModelConfig()).layers if layer.name == "fc1").shapes, 3)
FLOOR = FC1.numel // 3  # the shard size rounded down: exercise 09-2's usual mistake


def warmup_of(P, s, M, warmup):
    """One stage's ops with `warmup` forwards first, then 1F1B's steady state and cool-down."""
    ops = [("F", m) for m in range(warmup)]
    for m in range(M - warmup):
        ops += [("F", warmup + m), ("B", m)]
    return ops + [("B", m) for m in range(max(0, M - warmup), M)]


PSI = MLP(ModelConfig()).num_params
LOCAL_CASES = {  # notebook -> wrong answers whose lines its section must quote
    "03": [
        lambda: data_parallel.check_dp_traffic(
            lambda n, psi: 2 * (n - 1) / n * 4 * psi, data_parallel.dp_bytes_per_step(4, PSI)
        ),
        lambda: data_parallel.check_dp_traffic(
            lambda n, psi: (n - 1) / n * (4 * psi + 8), data_parallel.dp_bytes_per_step(4, PSI)
        ),
        lambda: data_parallel.check_dp_traffic(
            lambda n, psi: 2 * (n - 1) * (4 * psi + 8), data_parallel.dp_bytes_per_step(4, PSI)
        ),
        lambda: data_parallel.check_dp_traffic(
            lambda n, psi: 2 * (4 * psi + 8), data_parallel.dp_bytes_per_step(4, PSI)
        ),
    ],
    "04": [
        lambda: zero12.check_padding_bug(4, 0, 1756),
        lambda: zero12.check_padding_bug(4, 3, 1756),
        lambda: zero12.check_padding_bug(4, 3, 439),
        lambda: zero12.check_zero2_bytes(16e9),
        lambda: zero12.check_zero2_bytes(4e9 + 4e9 + 8e9 / 8),
        lambda: zero12.check_zero2_bytes(2e9),
        lambda: zero12.check_shard(lambda numel, n: (numel // n, numel % n)),
        lambda: zero12.check_shard(lambda numel, n: (-(-numel // n), numel % n)),
    ],
    "05": [
        lambda: zero3.check_gather_buffer(lambda config, n: right_gather(config, n) // 2),
        lambda: zero3.check_gather_buffer(
            lambda config, n: (
                8 * max(FlatParam(layer.shapes, 1).numel for layer in MLP(config).layers)
            )  # fmt: skip
        ),
        lambda: zero3.check_zero3_saving(
            lambda psi_pad, largest, n: 4 * psi_pad * (n - 1) / n - 8 * largest
        ),  # fmt: skip
    ],
    "01": [
        lambda: dataset.check_n_rows(lambda L: L),
        lambda: dataset.check_rows_of_rank([b for b in range(32) if b // 4 == 2]),
        lambda: dataset.check_rows_of_rank([b for b in range(32) if b % 8 == 3]),
    ],
    "02": [
        lambda: single_rank.check_count_params(count_params_without_biases),
        lambda: single_rank.check_leaky_relu_backward(lambda x, dout, k: dout * (x > 0)),
    ],
    "06": [  # exercise 1's table is checked before anything runs on the ranks
        lambda: fsdp_practice.check_prefetch_order(
            None, next_unit_without_ends, ModelConfig(layers=4, hidden=256), None
        ),
        lambda: fsdp_practice.check_prefetch_order(
            None,
            lambda u, backward, count: u + 1 if u + 1 < count else None,
            ModelConfig(layers=4, hidden=256),
            None,
        ),
    ],
    "07": [
        lambda: memory.check_smallest_n_70b(math.ceil(16 * 70e9 / 40e9)),
        lambda: memory.check_smallest_n_70b(math.floor(16 * 70e9 / memory.GPU_40)),
        lambda: memory.check_smallest_n(lambda *case: smallest_n(*case, rounding=math.floor)),
        lambda: memory.check_smallest_n(lambda *case: smallest_n(*case, whole_for_dp=True)),
    ],
    "08": [
        lambda: communication.check_hiding_batch(
            lambda *case: hiding_batch(*case, zero3_collectives=2)
        ),
        lambda: communication.check_hiding_batch(
            lambda *case: hiding_batch(*case, element_bytes=4)
        ),
        lambda: communication.check_ring_call_seconds(
            ring_call_seconds_without_the_allreduce_factor,
            {("seed", 4, "dp"): [one_report()]},
            {"alpha_s": 10e-6, "beta_s_per_byte": 1e-9},
        ),
    ],
    "09": [
        lambda: checkpoints.check_rank_1_of_3(
            (FLOOR, 2 * FLOOR), FC1.numel - 3 * FLOOR, ModelConfig()
        ),
        lambda: checkpoints.check_rank_1_of_3(
            FC1.shard_range(1), FC1.numel - 3 * FLOOR, ModelConfig()
        ),
        lambda: checkpoints.check_rank_1_of_3(
            (FC1.shard_range(1)[0], FC1.shard_range(1)[1] - 1), FC1.padding, ModelConfig()
        ),
        lambda: checkpoints.check_rank_1_of_3(FC1.shard_range(1), -FC1.padding, ModelConfig()),
    ],
    "12": [
        lambda: pipeline.check_1f1b(lambda P, s, M: schedule_ops("gpipe", P, s, M)),
        lambda: pipeline.check_1f1b(lambda P, s, M: warmup_of(P, s, M, P - s)),
        lambda: pipeline.check_1f1b(lambda P, s, M: warmup_of(P, s, M, P - s - 1)),
    ],
    "13": [
        lambda: many_hosts.check_prediction(
            lambda f, c, b: f + c / tcp_payload_rate(b) / 8, FAST_STEP, CABLE_BYTES
        ),
        lambda: many_hosts.check_prediction(lambda f, c, b: f + 8 * c / b, FAST_STEP, CABLE_BYTES),
        lambda: many_hosts.check_prediction(lambda f, c, b: f + c / b, FAST_STEP, CABLE_BYTES),
        lambda: many_hosts.check_prediction(
            lambda f, c, b: c / tcp_payload_rate(b), FAST_STEP, CABLE_BYTES
        ),
    ],
    "14": [
        lambda: transformer.check_causal_attention(wrong_attention(masked=False)),
        lambda: transformer.check_causal_attention(wrong_attention(mask_offset=-1)),
        lambda: transformer.check_causal_attention(wrong_attention(mask_offset=1)),
        lambda: transformer.check_causal_attention(wrong_attention(axis=0)),
        lambda: transformer.check_causal_attention(wrong_attention(scale=1.0)),
        lambda: transformer.check_block_shard_bytes(lambda e, f, n: -(-numel(e, f) // n)),
        lambda: transformer.check_block_shard_bytes(lambda e, f, n: 4 * -(-(numel(e, f) + e) // n)),
        lambda: transformer.check_block_shard_bytes(lambda e, f, n: 4 * numel(e, f) / n),
    ],
    "15": [
        lambda: context.check_merge(lambda o1, l1, o2, l2: ((o1 + o2) / 2, np.logaddexp(l1, l2))),
        lambda: context.check_merge(
            lambda o1, l1, o2, l2: (
                np.exp(l1 - np.maximum(l1, l2))[..., None] * o1
                + np.exp(l2 - np.maximum(l1, l2))[..., None] * o2,
                np.logaddexp(l1, l2),
            )
        ),
        lambda: context.check_merge(
            lambda o1, l1, o2, l2: (merge(o1, l1, o2, l2)[0], np.maximum(l1, l2))
        ),
        lambda: context.check_merge(lambda o1, l1, o2, l2: (merge(o1, l1, o2, l2)[0], l1 + l2)),
    ],
}


@pytest.fixture
def student(monkeypatch):
    monkeypatch.setattr(checks, "STRICT", False)


@pytest.mark.parametrize("number", sorted(LOCAL_CASES))
def test_the_guide_quotes_what_the_checkers_print(number, capsys, student):
    guide = quoted(number)
    for case in LOCAL_CASES[number]:
        line = printed(capsys, case)
        assert line in guide, f"teaching.md {number} should quote {line!r} (what it prints)"


def test_the_guide_quotes_a_converted_shard_as_the_checker_words_it():
    """09-1's float16 answer gets one line for all its arrays; a real dp at N = 1 gives it (a
    rank's keys and dtypes are the same at every N)."""
    from fsdp_lesson.checkpoint import owned_shards

    def converted(strategy):
        return {key: array.astype(np.float16) for key, array in owned_shards(strategy).items()}

    (line,) = checkpoints.owned_shards_verdict("dp", converted)
    assert f"dp rank 0: {line}" in " ".join(sections()["09"].split()), (
        f"teaching.md 09 should quote 'dp rank 0: {line}' (what the checker prints)"
    )


# On the cluster: the exercises whose functions run on the engines. Each wrong answer is
# defined there as a learner's %%px cell would define it.
SETUP_03 = """
from mpi4py import MPI
from fsdp_lesson.config import ModelConfig
from fsdp_lesson.data import Dataset, GlobalBatchSampler, rank_slice
from fsdp_lesson.model import MLP, loss_and_grads
from fsdp_lesson.rng import make_rng
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
model = MLP(ModelConfig())
rng = make_rng(42)
params = model.init_params(rng)
X, Y = GlobalBatchSampler(Dataset.load().X_train, Dataset.load().Y_train, 32, rng).next()
loss, grads = loss_and_grads(model, params, rank_slice(X, rank, size), rank_slice(Y, rank, size))
"""


def hsdp_groups(strided_shards=False, strided_replicas=True):
    """Exercise 06-3's answer, with its shard or replicate groups strided or consecutive."""

    def groups(n, replicate, strided):
        g = n // replicate
        if strided:
            return [list(range(first, n, g)) for first in range(g)]
        return [list(range(start, start + g)) for start in range(0, n, g)]

    return lambda n, r: (groups(n, r, strided_shards), groups(n, r, strided_replicas))


CLIP = """def clip_factor(grad_shards, comm, max_norm):
    squares = sum(float(np.dot(g.astype(np.float64), g)) for g in grad_shards.values())
    return min(1.0, max_norm / ({norm} + 1e-6))"""
RING_15 = """
from fsdp_lesson.attention import attention, merge
from fsdp_lesson.comm import Comm
cp = Comm.world()
"""  # notebook 15's setup %%px cell: the ring of exercise B
CLUSTER_CASES = {  # notebook -> (the engines' wrong definition, the checker)
    "03": [
        ("def allreduce_mean(comm, buf):\n    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)\n"
         "    return buf", data_parallel.check_allreduce_mean),
        ("def allreduce_mean(comm, buf):\n    out = np.zeros_like(buf)\n"
         "    comm.Reduce(buf, out, op=MPI.SUM, root=0)\n    buf[...] = out / comm.size\n"
         "    return buf", data_parallel.check_allreduce_mean),
        ("def allreduce_mean(comm, buf):\n    out = np.empty_like(buf)\n"
         "    comm.Allreduce(buf, out, op=MPI.SUM)\n    return out / comm.size",
         data_parallel.check_allreduce_mean),
        ("def average_grads(comm, grads):\n    for layer in grads.values():\n"
         "        for g in layer.values():\n"
         "            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)\n            g /= comm.size\n"
         "    return grads", data_parallel.check_average_grads),
        ("def average_grads(comm, grads):\n"
         "    mean = {n: {k: g.copy() for k, g in layer.items()} for n, layer in grads.items()}\n"
         "    for layer in mean.values():\n        for g in layer.values():\n"
         "            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)\n    return mean",
         data_parallel.check_average_grads),
    ],
    "04": [
        ("def zero1_update(adam, flat, params, grad_shard, state):\n"
         "    adam.update(flat.owned_shard(params, rank), grad_shard, state)\n    return params",
         zero12.check_zero1_update),
        ("def reduce_grads(flat, full_grad, grad_shard):\n"
         "    comm.Reduce_scatter_block(full_grad[: flat.padded_numel], grad_shard, op=MPI.SUM)\n"
         "    grad_shard /= comm.size\n    return grad_shard", zero12.check_reduce_grads),
        ("def reduce_grads(flat, full_grad, grad_shard):\n"
         "    full = full_grad[: flat.padded_numel]\n    full[flat.numel :] = 0\n"
         "    comm.Reduce_scatter_block(full, grad_shard, op=MPI.SUM)\n    return grad_shard",
         zero12.check_reduce_grads),
    ],
    "06": [  # exercise 4's three usual clippings, each named
        (CLIP.format(norm="np.sqrt(squares)"), fsdp_practice.check_clip_factor),
        (CLIP.format(norm="np.sqrt(comm.mean_scalar(squares))"), fsdp_practice.check_clip_factor),
        (CLIP.format(norm="comm.mean_scalar(float(np.sqrt(squares)))"),
         fsdp_practice.check_clip_factor),
        ("def clip_factor(grad_shards, comm, max_norm):\n"  # no min(1.0, ...): it scales up
         "    squares = sum(float(np.dot(g.astype(np.float64), g)) for g in grad_shards.values())\n"
         "    return max_norm / (np.sqrt(comm.mean_scalar(squares) * comm.size) + 1e-6)",
         fsdp_practice.check_clip_factor),
        # exercise 3's groups: strided shard groups, then consecutive replicate groups too
        ("", lambda ranks: fsdp_practice.check_groups(ranks, hsdp_groups(strided_shards=True),
                                                      ModelConfig(layers=4, hidden=256))),
        ("", lambda ranks: fsdp_practice.check_groups(ranks, hsdp_groups(strided_replicas=False),
                                                      ModelConfig(layers=4, hidden=256))),
    ],
    "15": [
        (RING_15 + "def my_ring_step(q, k, v, out, lse, positions, cp):\n"
         "    kv = np.stack([k, v])\n    received = np.empty_like(kv)\n"
         "    cp.send(kv, (cp.rank + 1) % cp.size)\n"
         "    cp.irecv(received, (cp.rank + 1) % cp.size).wait()\n    return out, lse",
         context.check_ring_step),
        (RING_15 + "def my_ring_step(q, k, v, out, lse, positions, cp):\n"
         "    kv = np.stack([k, v])\n    received = np.empty_like(kv)\n"
         "    before = (cp.rank + 1) % cp.size\n"
         "    sending = cp.send(kv, (cp.rank - 1) % cp.size)\n"
         "    cp.irecv(received, before).wait()\n    sending.wait()\n"
         "    part = attention(q, received[0], received[1], positions[cp.rank],\n"
         "                     positions[before])\n"
         "    return merge(out, lse, *part)", context.check_ring_step),
        (RING_15 + "def my_ring_step(q, k, v, out, lse, positions, cp):\n"
         "    kv = np.stack([k, v])\n    received = np.empty_like(kv)\n"
         "    before = (cp.rank - 1) % cp.size\n"
         "    sending = cp.send(kv, (cp.rank + 1) % cp.size)\n"
         "    cp.irecv(received, before).wait()\n    sending.wait()\n"
         "    return attention(q, received[0], received[1], positions[cp.rank], positions[before])",
         context.check_ring_step),
    ],
}  # fmt: skip
SHARD_16 = "from torch.distributed.fsdp import fully_shard\n\ndef shard_model(model):\n"
LAYERS_16 = "    for name in model.order{}:\n        fully_shard(getattr(model, name){})\n"
if importlib.util.find_spec("torch") is not None:  # notebook 16's checker runs PyTorch
    CLUSTER_CASES["16"] = [
        (SHARD_16 + body, bridge.check_shard_model)
        for body in (
            "    return model\n",
            "    return fully_shard(model)\n",
            LAYERS_16.format("", "") + "    return model\n",
            "    fully_shard(model)\n" + LAYERS_16.format("", "") + "    return model\n",
            LAYERS_16.format("", ", reshard_after_forward=False")
            + "    return fully_shard(model, reshard_after_forward=False)\n",
            LAYERS_16.format("[1:]", "") + "    return fully_shard(model)\n",
            LAYERS_16.format("", "") + "    fully_shard(model)\n",
        )
    ]


@pytest.fixture(scope="module")
def ranks():
    from fsdp_lesson.cluster import connect

    with connect(n=4, profile="teaching", timeout=120) as ranks:
        ranks.view.execute("import numpy as np\n" + SETUP_03, block=True)
        yield ranks


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("number", sorted(CLUSTER_CASES))
def test_the_guide_quotes_what_the_cluster_checkers_print(number, ranks, capsys, student):
    guide = quoted(number)
    for definition, checker in CLUSTER_CASES[number]:
        ranks.view.execute(textwrap.dedent(definition), block=True)
        line = printed(capsys, lambda checker=checker: checker(ranks))
        assert line in guide, f"teaching.md {number} should quote {line!r} (what it prints)"


MY_ZERO3 = """
from fsdp_lesson.strategies.base import Strategy


class MyZeRO3(Strategy):
    name = "my_zero3"
    shard_level = 3  # as notebook 05's class (the attribute was once `stage`)

    def __init__(self, model, optimizer, comm, ledger):
        super().__init__(model, optimizer, comm, ledger)
        self.param_shards = self.alloc_per_layer("params", "param_shard")
        self.grad_shards = self.alloc_per_layer("grads", "grad_shard")
        self.opt_state = self.init_optimizer_state()
        self.gathered, self.full_grads = {}, {}

    def param_arrays(self):
        return self.param_shards

    def step(self):
        self.optimizer.start_step()
        for name in self.layout:
            self.optimizer.update(self.param_shards[name], self.grad_shards[name],
                                  self.opt_state[name])

    def materialize(self, layer):
        flat = self.layout[layer.name]
        if layer.name not in self.gathered:
            full = self.ledger.alloc("buffers", flat.padded_numel, f"{layer.name} gathered")
            self.comm.allgather(self.param_shards[layer.name], full)
            self.gathered[layer.name] = full
        return flat.views(self.gathered[layer.name])

    def release(self, layer):
        self.ledger.free(f"{layer.name} gathered")  # the count freed, the array kept

    def grad_buffer(self, layer):
        flat = self.layout[layer.name]
        full = self.ledger.alloc("buffers", flat.padded_numel, f"{layer.name} full grad")
        self.full_grads[layer.name] = full
        return flat.views(full)

    def reduce_grads(self, layer):
        full = self.full_grads.pop(layer.name)
        self.comm.reduce_scatter_mean(full, self.grad_shards[layer.name])
        self.ledger.free(f"{layer.name} full grad")
"""


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_my_zero3_that_sums_the_gradients_names_the_factor(ranks, capsys, student):
    summed = MY_ZERO3.replace(
        'self.ledger.free(f"{layer.name} gathered")  # the count freed, the array kept',
        'del self.gathered[layer.name]\n        self.ledger.free(f"{layer.name} gathered")',
    ).replace("reduce_scatter_mean(", "reduce_scatter_sum(")
    ranks.view.execute(summed, block=True)
    assert zero3.check_my_zero3(ranks) is False
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "✗ MyZeRO3 differs from the package's zero3:"
    assert lines[1].strip() == (
        "every rank: emb's gradient shard at the last update is 4 times zero3's: the sum over"
        " the ranks, where zero3 keeps their mean?"
    )
    assert lines[1].strip() in " ".join(sections()["05"].split())


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_my_zero3_that_frees_the_count_but_keeps_the_array_fails_and_says_so(
    ranks, capsys, student
):
    ranks.view.execute(MY_ZERO3, block=True)
    assert zero3.check_my_zero3(ranks) is False
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "✗ MyZeRO3 differs from the package's zero3:"
    cause = lines[1].strip()  # the cause first, then its symptoms
    assert "self.gathered still holds its array" in cause, lines
    assert cause in " ".join(sections()["05"].split()), f"teaching.md 05 should quote {cause!r}"
