"""Sizes refused before anything is built: a model whose parameters alone cannot fit.

The exact prediction (train.check_memory) runs the strategy's own code on placeholders, which
takes time in proportion to the layers and the elements it lays out: at --hidden 10^9 or
--layers 10^8 that is minutes, and the model it builds takes gigabytes. This bound is counted
from ModelConfig's widths alone, in Python integers (exact at any size): every parameter is
held somewhere in float32 at least once (the master copy), so the ranks together hold at
least 4 bytes per parameter, and some rank at least 1/N of them. A run over that bound cannot
fit, whatever the strategy; a run under it goes on to the exact prediction.
"""

from __future__ import annotations

from .config import ConfigError, ModelConfig

MIB = 2**20
ADDRESSABLE = 2**63 - 1  # bytes numpy can index (np.intp): a bound where memory is unknown


def parameter_count(config: ModelConfig) -> int:
    """The MLP's parameters (model.MLP's layers), counted without building it."""
    inputs, hidden, vocab = config.seq_len * config.emb, config.hidden, config.vocab_size
    first = inputs * hidden + hidden  # fc1: the embedded context in, W and b
    middle = (config.layers - 1) * (hidden * hidden + hidden)  # fc2 ... fc(layers)
    last = hidden * vocab + vocab  # the output layer
    return vocab * config.emb + first + middle + last


def layers_with_parameters(config: ModelConfig) -> tuple[int, str]:
    """How many layers hold parameters (the units zero3 can make), and their names for a
    message (the middle elided past six): --layers 10^8 builds no list of 10^8 names."""
    count = config.layers + 2  # emb, fc1 ... fc(layers + 1)
    names = ["emb", *(f"fc{i}" for i in range(1, min(count, 6)))]
    if count > 6:
        names[-1:] = ["...", f"fc{config.layers + 1}"]
    return count, ", ".join(names)


def rounded(n: int) -> str:
    """An integer of any size in a few characters: 12,345 or 1.23e+20 (no float conversion,
    which overflows above 1e308)."""
    if n < 10**6:
        return f"{n:,}"
    digits = str(n)
    return f"{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"


def meminfo(field: str) -> int | None:
    """A field of /proc/meminfo in bytes ("MemTotal": the same on every rank of a host, and
    constant; "MemAvailable": what the machine can still give), or None where it cannot be
    read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_model_fits(config: ModelConfig, ranks: int, budget_mb: float | None = None) -> None:
    """Refuse a model whose float32 parameters alone, spread evenly over `ranks`, exceed the
    budget or this machine's memory (or what numpy can address): one line, before anything
    is allocated. Deterministic: every rank of a host reaches the same verdict."""
    count = parameter_count(config)
    need = -(-4 * count // ranks)  # bytes per rank, at the least
    limits = []
    if budget_mb is not None:
        limits.append((budget_mb * MIB, f"the budget of {budget_mb:g} MiB"))
    total = meminfo("MemTotal")
    if total is not None:
        limits.append((total, f"this machine's memory ({total / MIB:,.0f} MiB in all)"))
    limits.append((ADDRESSABLE, "what numpy can address"))
    over = [what for limit, what in limits if need > limit]
    if over:
        on = f"{ranks} rank" + ("s" if ranks > 1 else "")
        raise ConfigError(
            f"this run would need at least {rounded(-(-need // MIB))} MiB per rank (the model's "
            f"{rounded(count)} parameters in float32 alone, on {on}; predicted before "
            f"allocating anything), more than {over[0]}: use a smaller --hidden, --emb or "
            f"--layers, or more ranks"
        )
