"""Notebook 13's exercise (many hosts): predict a step's time at a bandwidth not yet run. The
checker computes the prediction with `commbench.tcp_payload_rate` itself, so the student's
cell shows only the call; a wrong prediction is named by its mistake (bits for bytes, the
frames' headers, the compute left out), never by the expected value."""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real

from ..checks import NOT_SOLVED, fail, how_wrong, not_solved
from ..commbench import FRAME, TCP_PAYLOAD, tcp_payload_rate

FREE = 1e15  # bits per second of a link so fast that it costs nothing
ASKED = 300e6  # the bandwidth the exercise predicts, and the next cell runs
RTOL = 0.01  # of the link's time: the headers (4.6 %) and bits for bytes (8×) lie outside


def predicted_step(fast_step: float, cable_bytes: float, bits_per_second: float) -> float:
    """The fast link's step plus the time the cable's bytes take at the link's payload rate."""
    return fast_step + cable_bytes / tcp_payload_rate(bits_per_second)


def link_mistake(link: float, cable_bytes: float, bits_per_second: float) -> str:
    """How a predicted link time is off, as '<how> — <why>': a usual mistake by name, else
    how_wrong's direction or factor and a question."""
    rate = tcp_payload_rate(bits_per_second)
    bits = cable_bytes * 8 / bits_per_second  # the bytes as bits at the link's rate
    mistakes = (
        (cable_bytes / rate / 8, "too small by a factor of 8: bytes divided by bits per second",
         "a link of b bits per second moves b/8 bytes"),
        (cable_bytes / bits_per_second, "too small by a factor of about 8.4: bytes divided by"
         " bits per second, and no headers", "a link of b bits per second moves b/8 bytes,"
         " in frames"),
        (bits, "too small by about 4 %: the frames' headers are left out",
         f"each {TCP_PAYLOAD} bytes of payload travel in a {FRAME}-byte frame"),
        (8 * cable_bytes / rate, "too large by a factor of 8: the bytes made bits twice",
         "tcp_payload_rate is in bytes per second already"),
        (cable_bytes * rate, "the bytes multiplied by the rate", "time is bytes over bytes per"
         " second"),
        (2 * cable_bytes / rate, "too large by a factor of 2: both directions counted",
         "a cable carries its two directions at once, and cable_bytes is one direction's"),
    )  # fmt: skip
    for value, how, why in mistakes:
        if abs(link - value) <= RTOL * abs(value):
            return f"{how} — {why}"
    return f"{how_wrong(link, cable_bytes / rate)} — bits or bytes? and the headers of every frame"


def check_prediction(predict: Callable, fast_step: float, cable_bytes: float) -> bool:
    """predict(fast_step, cable_bytes, bits_per_second) asked about a link that costs nothing
    (the fast step must be left) and about 300 Mbit/s (the link's part within 1 %)."""
    name = "predicted step at 300 Mbit/s"
    free, asked = predict(fast_step, cable_bytes, FREE), predict(fast_step, cable_bytes, ASKED)
    if not_solved(free) or not_solved(asked):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    if not isinstance(free, Real) or not isinstance(asked, Real):
        return fail(f"✗ {name}: a {type(asked).__name__}, where seconds (a number) are expected")
    hint = "what is left of a step when the link takes no time?"
    if abs(free) <= 0.05 * fast_step:
        return fail(
            f"✗ a link that costs nothing: about 0 s, the fast link's step left out — {hint}"
        )
    if abs(free - predicted_step(fast_step, cable_bytes, FREE)) > 0.001 * fast_step:
        how = "too large" if free > fast_step else "too small"
        if abs(free - 1e3 * fast_step) <= 0.001 * 1e3 * fast_step:
            return fail(
                "✗ a link that costs nothing: too large by a factor of 1000: milliseconds,"
                " where seconds are asked for"
            )
        return fail(
            f"✗ a link that costs nothing: {how}, where the fast link's step is left — {hint}"
        )
    print("✓ a link that costs nothing: correct")
    link, want = asked - fast_step, cable_bytes / tcp_payload_rate(ASKED)
    if abs(link - want) <= RTOL * want:
        print(f"✓ {name}: correct")
        return True
    return fail(f"✗ {name}: the link's time is {link_mistake(link, cable_bytes, ASKED)}")
