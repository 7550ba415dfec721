"""How KIVI stores keys and values (Part 3, section 19): a group of keys by channel, a value
by token, and back.

KIVI (arXiv 2402.02750) gives each channel of a group of keys, and each value, a zero
point and a scale (32-bit floats here, as its kernels keep them): the smallest number is
level 0, the largest the top level, 2 ** bits - 1, and each number becomes its nearest
level, packed 8 // bits to a byte. Given back, a level times its scale plus its zero
point. quantization.GroupedCache keeps its keys and values so; bytes_by_formula counts
what it holds.
"""
import math
import struct
from array import array

import model

BITS = (2, 4, 8, 64)   # 64: no levels, every number kept as a float64 (the rotation alone)


def check_sizes(bits, group=1, residual=1):
    """Refuse bits, a group or a residual that a GroupedCache cannot have.

    Bits other than BITS' (16 or 9 would pack no level in a byte); a group or a residual
    not from 1 to the 64 positions."""
    if not model.is_int(bits) or bits not in BITS:
        raise ValueError(f"bits must be 2, 4, 8 or 64, got {model.excerpt(bits)}")
    model.check_int("group", group, 1, model.CONTEXT, " (positions)")
    model.check_int("residual", residual, 1, model.CONTEXT, " (the newest positions, kept exact)")


def _f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _grid(numbers, top):
    """Zero point and scale numbers share, 32-bit floats: smallest to level 0, largest to top."""
    low = min(numbers)
    return _f32(low), _f32((max(numbers) - low) / top)


def _level(x, zero, scale, top):
    """The nearest level of x from 0 to top (ties to the even one, as round does)."""
    return min(top, max(0, round((x - zero) / scale))) if scale else 0


def _packed(levels, bits):
    """Levels of bits bits, 8 // bits to a byte, the first in the lowest bits."""
    per = 8 // bits
    return bytes(sum(level << bits * i for i, level in enumerate(levels[at:at + per]))
                 for at in range(0, len(levels), per))


def _unpacked(data, bits):
    mask = (1 << bits) - 1
    return [byte >> bits * i & mask for byte in data for i in range(8 // bits)]


def keys_by_channel(keys, bits):
    """Store a group of keys: per channel, a zero point and a scale over the group (_grid).

    Each number becomes its level, packed position by position; at 64 bits, the numbers.
    keys: one or more, each of 16 numbers."""
    check_sizes(bits)
    if not keys or any(len(key) != model.WIDTH for key in keys):
        raise ValueError(f"keys must be a non-empty list of keys of {model.WIDTH} numbers, got "
                         f"{model.excerpt(keys)}")
    if bits == 64:
        return (array("d", [x for key in keys for x in key]),)
    top = 2 ** bits - 1
    zeros, scales = zip(*(_grid(channel, top) for channel in zip(*keys)))
    levels = [_level(x, zero, scale, top)
              for key in keys for x, zero, scale in zip(key, zeros, scales)]
    return _packed(levels, bits), array("f", zeros), array("f", scales)


def value_by_token(value, bits):
    """Store one value: one zero point and one scale over its 16 numbers (_grid).

    Each number becomes its level, packed; at 64 bits, the numbers."""
    check_sizes(bits)
    if bits == 64:
        return (array("d", value),)
    top = 2 ** bits - 1
    zero, scale = _grid(value, top)
    return _packed([_level(x, zero, scale, top) for x in value], bits), array("f", [zero, scale])


def given_back(stored, bits, per_channel):
    """Give the vectors that stored stands for: each level times its scale, plus its zero point.

    stored: keys_by_channel's (per_channel) or value_by_token's."""
    if bits == 64:
        numbers = list(stored[0])
    else:
        data, *grids = stored
        zeros, scales = grids if per_channel else ([grids[0][0]], [grids[0][1]])
        numbers = [level * scales[i % len(scales)] + zeros[i % len(zeros)]
                   for i, level in enumerate(_unpacked(data, bits))]
    return [numbers[at:at + model.WIDTH] for at in range(0, len(numbers), model.WIDTH)]


def stored_bytes(stored):
    """The bytes of what keys_by_channel or value_by_token stored."""
    return sum(len(part) * getattr(part, "itemsize", 1) for part in stored)


def bytes_by_formula(bits, group, residual, positions):
    """Give the bytes per position of a GroupedCache holding positions positions (1 or more).

    16 numbers a key and 16 a value, bits / 8 bytes each once quantized, 8 while exact; 4 bytes
    each zero point and scale, one of each per channel of a group of keys (the last perhaps short)
    and per value. The exact: those fed since the last flush, 1 to residual. Refuses what
    GroupedCache refuses of bits, group and residual, and positions beyond what it holds."""
    check_sizes(bits, group, residual)
    model.check_int("positions", positions, 1, model.CONTEXT, " (the positions a GroupedCache "
                    "holds)")
    exact = (positions - 1) % residual + 1
    quantized = positions - exact
    grids = 0 if bits == 64 else model.WIDTH * math.ceil(quantized / group) + quantized
    return (2 * model.WIDTH * (quantized * bits / 8 + exact * 8) + 8 * grids) / positions
