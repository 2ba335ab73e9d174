"""The transformer (`--model gpt`, fsdp_lesson/gpt.py): every layer's backward against finite
differences, what its forward keeps against what the dry run counts, the refusals of the flags
that split a sequence; then, under mpiexec (tests/gpt_worker.py: one launch of 4 ranks, one of
8), every strategy and mesh (tp, sequence parallelism, pp, cp with ring attention, and all of
them at once) against single-rank training within 1e-5, every rank's ledger as plan.ledger_bytes
predicts it to the byte, and a checkpoint saved on one mesh resumed on another."""

from functools import cache

import numpy as np
import pytest
from mpi_helpers import worker_results

from fsdp_lesson.admission import memory_options
from fsdp_lesson.config import ConfigError, ModelConfig, TrainConfig, check_model_options
from fsdp_lesson.data import Dataset
from fsdp_lesson.gpt import GPT, Block, Head
from fsdp_lesson.model import loss_and_grads
from fsdp_lesson.plan import ledger_bytes
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import strategy_options
from fsdp_lesson.train import run, whole_params

TINY = ModelConfig(model="gpt", emb=8, heads=2, hidden=12, layers=2, seq_len=5)

# --- without MPI ----------------------------------------------------------------------------


def float64_params(model: GPT, seed: int = 1) -> dict:
    """The model's initial parameters in float64, nudged so that LayerNorm gains and biases are
    not 1 and 0 (their gradients are then generic)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, p in model.init_params(make_rng(seed)).items():
        params[name] = {
            k: v.astype(np.float64) + 0.1 * rng.standard_normal(v.shape) for k, v in p.items()
        }
    return params


def test_every_layers_backward_matches_finite_differences():
    """Central differences of the loss in float64 at 20 entries of every parameter."""
    model = GPT(TINY)
    params = float64_params(model)
    rng = np.random.default_rng(0)
    X, Y = rng.integers(0, 27, (3, TINY.seq_len)), rng.integers(0, 27, 3)
    targets = model.targets(X, Y)
    _, grads = loss_and_grads(model, params, X, targets)
    for name, layer_params in params.items():
        for key, value in layer_params.items():
            entries = list(np.ndindex(value.shape))
            for i in entries[:: max(1, len(entries) // 20)]:
                old = value[i]
                value[i] = old + 1e-6
                up = loss_and_grads(model, params, X, targets)[0]
                value[i] = old - 1e-6
                down = loss_and_grads(model, params, X, targets)[0]
                value[i] = old
                numeric = (up - down) / 2e-6
                assert abs(numeric - grads[name][key][i]) <= 1e-7, (
                    f"{name}.{key}{i}: backward gives {grads[name][key][i]:.6g}, finite "
                    f"differences {numeric:.6g}"
                )


def test_the_keys_have_no_bias():
    """Softmax ignores what is added to all of a query's scores, q . b_k: such a bias gets no
    gradient but rounding, which Adam would turn into steps (Block's docstring)."""
    model = GPT(TINY)
    assert "bk" not in model.layers[1].shapes and "bq" in model.layers[1].shapes


@pytest.mark.parametrize("rows", [1, 3])
def test_what_forward_keeps_is_what_the_dry_run_counts(rows):
    """cache_bytes, which the dry run (and so the planner) uses, is the bytes of what the
    block's and the head's forward really keep."""
    model = GPT(TINY)
    params = model.init_params(make_rng(1))
    x = np.random.default_rng(0).integers(0, 27, (rows, TINY.seq_len))
    for layer in model.layers:
        out, saved = layer.forward(params[layer.name], x)
        if isinstance(layer, (Block, Head)):
            assert layer.cache_bytes(rows) == saved.nbytes, layer.name
        x = out


def test_targets_are_every_positions_next_token():
    X = np.array([[1, 2, 3, 4, 5]])
    assert GPT(TINY).targets(X, np.array([6])).tolist() == [[2, 3, 4, 5, 6]]


@pytest.mark.parametrize(
    ("model", "train", "says"),
    [
        (ModelConfig(), dict(tp=2, sequence_parallel=True), "--sequence-parallel splits"),
        (ModelConfig(), dict(cp=2), "--cp splits a transformer's sequence"),
        (ModelConfig(model="gpt"), dict(c_compat=True), "--c-compat reproduces"),
        (ModelConfig(model="gpt", heads=4), dict(tp=3), "heads do not split into 3"),
        (ModelConfig(model="gpt"), dict(sequence_parallel=True), "use it with --tp T"),
        (ModelConfig(model="gpt"), dict(cp=3), "use a --seq-len that is a multiple of 6"),
        (
            ModelConfig(model="gpt", heads=16, emb=32),
            dict(cp=2, cp_layout="contiguous", tp=16, sequence_parallel=True),
            "use a --tp that divides 8",
        ),
    ],
)
def test_flags_that_split_a_sequence_are_refused_with_the_fix(model, train, says):
    with pytest.raises(ConfigError, match=says):
        check_model_options(model, TrainConfig(**train))


def test_single_runs_on_context_parallel_ranks_but_not_on_data_parallel_ones():
    TrainConfig(cp=2).validate(2)  # one copy of the model, its sequences cut in two
    with pytest.raises(ConfigError, match="has 2 data-parallel ranks .*use --strategy dp"):
        TrainConfig(cp=2).validate(4)


def test_replicate_and_cp_are_refused_together():
    with pytest.raises(ConfigError, match="use one of --replicate and --cp"):
        TrainConfig(strategy="zero3", replicate=2, cp=2).validate(8)


# --- under mpiexec: every mesh against one rank ----------------------------------------------


@pytest.fixture(scope="module", params=[4, 8], ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    return request.param, worker_results(request.param, "gpt_worker.py", tmp_path_factory, 600)


MESH = ("strategy", "tp", "pp", "cp", "cp_layout", "sequence_parallel", "micro_batches", "schedule")


@cache
def single_run(train_config: TrainConfig):
    """The run of train_config on one rank: no mesh, strategy single, the same batches."""
    fields = {k: v for k, v in train_config.to_dict().items() if k not in MESH}
    config = TrainConfig(**(fields | {"strategy": "single"}))
    history, strategy = run(ModelConfig(model="gpt", layers=2), config, data=Dataset.load())
    return history, whole_params(strategy)


@pytest.mark.mpi
def test_every_mesh_trains_the_transformer_as_one_rank_does(world):
    """Losses, parameters, validation loss and samples within 1e-5 of single's (SGD and Adam);
    bf16 within its own precision (the losses 2^-8 relative, as test_levers argues)."""
    n, results = world
    for name, r in results.items():
        history, params = single_run(r["train_config"])
        if r["train_config"].precision == "bf16":
            rel = np.abs(r["losses"] - history.losses) / history.losses
            assert rel.max() <= 2**-8, f"{name} N={n}: loss differs by {rel.max():.1e} (relative)"
            continue
        loss_diff = np.abs(r["losses"] - history.losses).max()
        assert loss_diff <= 1e-5, f"{name} N={n}: loss differs by {loss_diff:.1e}"
        for layer, p in params.items():
            for key, value in p.items():
                diff = np.abs(r["params"][layer][key] - value).max()
                assert diff <= 1e-5, f"{name} N={n}: {layer}.{key} differs by {diff:.1e}"
        if history.val_loss is not None:
            assert abs(r["val_loss"] - history.val_loss) <= 1e-5, f"{name} N={n}: validation loss"
        assert r["samples"] == history.samples, f"{name} N={n}: samples differ from single's"


@pytest.mark.mpi
def test_every_ranks_ledger_is_predicted_to_the_byte(world):
    n, results = world
    for name, r in results.items():
        tc = r["train_config"]
        dp = n // (tc.tp * tc.pp * tc.cp)
        for rank, mine in enumerate(r["per_rank"]):
            want = ledger_bytes(
                tc.strategy,
                ModelConfig(model="gpt", layers=2),
                dp,
                tc.optimizer,
                tc.batch // dp,
                recompute=tc.recompute,
                tp=tc.tp,
                pp=tc.pp,
                stage=mine["coords"]["pp"],
                micro_batches=tc.micro_batches,
                schedule=tc.schedule,
                sequence_parallel=tc.sequence_parallel,
                cp=tc.cp,
                cp_layout=tc.cp_layout,
                **memory_options(tc),
                **strategy_options(tc.strategy, tc),
            )
            assert mine["peak"] == want, f"{name} N={n} rank {rank}"


@pytest.mark.mpi
def test_context_parallel_ranks_pass_kv_and_only_they(world):
    """Ring attention's K/V travel over cp: each cp run's ranks send on their cp Comm (named
    as the world when cp is all of it), and a run without cp sends nothing there."""
    n, results = world
    for name, r in results.items():
        cp = r["train_config"].cp
        kind = "send" if cp == n else "send (cp)"
        sent = [mine["traffic"].get(kind, {}).get("sent_bytes", 0) for mine in r["per_rank"]]
        if cp > 1:
            assert all(sent), f"{name} N={n}: a cp rank sent no K/V"
        else:
            assert not any(sent), f"{name} N={n}: K/V sent without cp"


@pytest.mark.mpi
def test_zero3s_traffic_measured_on_the_ring_is_the_traffic_counted(world):
    """zero3's gathers and reduce-scatters of the transformer's blocks: the bytes ring.py's
    rings send (--collectives ring, measured) are the bytes the ring model counts for MPI's."""
    n, results = world
    if n != 4:
        pytest.skip("the 4-rank launch runs zero3 on the ring")
    ring, mpi = results["zero3-ring"]["per_rank"], results["zero3-adam"]["per_rank"]
    for rank, (measured, counted) in enumerate(zip(ring, mpi, strict=True)):
        for kind in ("allgather", "reduce_scatter"):
            assert measured["traffic"][kind]["how"] == "measured", kind
            assert counted["traffic"][kind]["how"] == "counted", kind
            sent = measured["traffic"][kind]["sent_bytes"]
            assert sent == counted["traffic"][kind]["sent_bytes"] > 0, f"rank {rank} {kind}"


@pytest.mark.mpi
def test_the_kv_sends_are_the_ones_counted(world):
    """Measured bytes on the cp ring, against the count by hand (docs/long_context.md): per
    layer and step, the K/V block (2 * B * H * S/C * D float32) goes C - 1 hops in forward, and
    in backward C - 1 again and its dK/dV C (one more, home); recompute runs forward's again."""
    n, results = world
    for name, r in results.items():
        if not name.endswith("-counted"):
            continue
        tc, model = r["train_config"], ModelConfig(model="gpt", layers=2)
        rows = tc.batch // (n // tc.cp)  # a data-parallel rank's rows: dp = N / cp here
        block = 4 * 2 * rows * model.seq_len // tc.cp * model.emb  # H * D = E
        hops = 3 * (tc.cp - 1) + 1 + (tc.cp - 1) * tc.recompute
        for rank, mine in enumerate(r["per_rank"]):
            sent = mine["traffic"]["send (cp)"]["sent_bytes"]
            counted = tc.steps * model.layers * hops * block
            assert sent == counted, f"{name} rank {rank}: {sent} bytes sent, {counted} counted"


@pytest.mark.mpi
def test_a_checkpoint_of_one_mesh_resumes_on_another(world):
    """Saved by tp 2 x cp 2 zero3 at step 6, resumed by cp 4 dp: the 12 steps are one rank's."""
    n, results = world
    if n != 4:
        pytest.skip("the 4-rank launch saves and resumes")
    r = results["resumed"]
    assert r["resumed_from"]["step"] == 6
    history, params = single_run(r["train_config"])
    diff = np.abs(r["losses"][6:] - history.losses[6:]).max()
    assert diff <= 1e-5, f"resumed run: loss differs by {diff:.1e}"
    for layer, p in params.items():
        for key, value in p.items():
            assert np.abs(r["params"][layer][key] - value).max() <= 1e-5, f"{layer}.{key}"
