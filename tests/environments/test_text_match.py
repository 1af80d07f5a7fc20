"""Building text on device (``environments.text_match``): against Python's own ``str`` formatting."""
import jax
import jax.numpy as jnp
import numpy as np

from environments import text_match


def _text(data, n):
    return bytes(np.asarray(data)[: int(n)].tolist()).decode()


def test_decimal_spells_every_value_as_str_does():
    spell = jax.jit(jax.vmap(lambda v: text_match.decimal(v, 3)))
    values = np.arange(1000)
    data, n = spell(jnp.asarray(values))
    assert [_text(data[i], n[i]) for i in values] == [str(v) for v in values]
    assert _text(*text_match.decimal(7, 1)) == "7"


def test_concat_joins_the_used_part_of_each_segment_and_cuts_at_width():
    rng = np.random.default_rng(0)
    words = ["ab", "", "cde", "(", "12345", ", "]
    for _ in range(20):
        picks = rng.integers(0, len(words), 5)
        used = rng.integers(0, 6, 5)
        segments = [(text_match.literal(words[p])[0] if words[p] else jnp.zeros((0,), jnp.uint8), jnp.int32(u))
                     for p, u in zip(picks, used)]
        expected = "".join(words[p][:u] for p, u in zip(picks, used))
        assert _text(*text_match.concat(segments, 32)) == expected
        assert _text(*text_match.concat(segments, 4)) == expected[:4]


def test_starts_with_needs_the_whole_prefix_inside_the_text():
    prefix, m = text_match.concat([text_match.literal("The cell (1, 2);")], 24)
    def check(text, n=None):
        data, size = text_match.encode(text, 40)
        return bool(text_match.starts_with(jnp.asarray(data), jnp.int32(size if n is None else n), prefix, m))
    assert check("The cell (1, 2); moving Up")
    assert not check("The cell (1, 3); moving Up") and not check("the cell (1, 2);")
    assert not check("The cell (1, 2); moving Up", n=10)  # the text ends before the prefix does
    short = np.frombuffer(b"The cell", np.uint8)
    assert not bool(text_match.starts_with(jnp.asarray(short), jnp.int32(8), prefix, m))  # shorter than W


def test_encode_pads_and_cuts_at_width():
    data, n = text_match.encode("Up é", 8)  # "é" is two UTF-8 bytes
    assert n == 5 and data.dtype == np.uint8 and bytes(data[:n]) == "Up é".encode() and not data[n:].any()
    data, n = text_match.encode("Right || Up", 5)
    assert n == 5 and bytes(data) == b"Right"
