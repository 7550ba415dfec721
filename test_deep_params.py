"""The deeper model's shapes and parameters (deep_params.py): every parameter init_params
makes has the shape its docstring gives, worked out plainly here, the spread of its std,
its gains 1.0 and its biases 0.0; check_params takes what init_params makes and refuses a parameter one row or
entry short, or holding nan; shapes too large to build are refused at once."""
import math
import re
import time
import unittest

import deep_model
import deep_params
import support
import verdicts
from model import CONTEXT, VOCAB_SIZE
from support import swapping
from verdicts import Layer, Wrong, deep_label, step

# Shapes the quick check makes: grouped-query, multi-query (rotary), latent, latent rotary.
LAYER = Layer("deep_params", "the deeper model's shapes and parameters (deep_params.py)",
              ())


TRIED = ((2, 4, 2, 16, 0), (1, 4, 1, 16, 0, "rotary"), (1, 4, 4, 16, 0, "learned", 8),
         (1, 4, 4, 16, 0, "rotary", 8))


def setUpModule():
    verdicts.set_up("deep_params")   # runs from elsewhere


tearDownModule = support.tear_down


def worked_out(shape):
    """Each parameter's (rows, columns), or (entries,), as init_params's docstring says:
    name -> dims, and "blocks[l]['name']" -> dims for each layer l."""
    width, heads, latent = shape["width"], shape["heads"], shape["latent"]
    head_width = width // heads
    dims = {"tok_emb": (VOCAB_SIZE, width), "lnf_g": (width,), "lnf_b": (width,),
            "W_out": (width, VOCAB_SIZE), "b_out": (VOCAB_SIZE,)}
    if shape["positions"] == "learned":
        dims["pos_emb"] = (CONTEXT, width)
    block = {"ln1_g": (width,), "ln1_b": (width,), "Wq": (width, width), "Wo": (width, width),
             "ln2_g": (width,), "ln2_b": (width,), "W1": (width, 4 * width),
             "b1": (4 * width,), "W2": (4 * width, width), "b2": (width,)}
    if latent is None:
        block["Wk"] = block["Wv"] = (width, shape["kv_heads"] * head_width)
    else:
        block.update(Wdkv=(width, latent), lnc_g=(latent,), lnc_b=(latent,),
                     Wuk=(latent, width), Wuv=(latent, width))
        if shape["rotary_key"]:
            block.update(Wqr=(width, heads * shape["rotary_key"]),
                         Wkr=(width, shape["rotary_key"]))
    for layer in range(shape["layers"]):
        dims.update({f"blocks[{layer}][{name!r}]": d for name, d in block.items()})
    return dims


def held(params):
    """What params hold, by the names worked_out gives: name -> the value."""
    values = {name: value for name, value in params.items() if name not in ("shape", "blocks")}
    for layer, block in enumerate(params["blocks"]):
        values.update({f"blocks[{layer}][{name!r}]": value for name, value in block.items()})
    return values


def dims_of(value):
    """A matrix's (rows, columns) or a vector's (entries,), as measured."""
    return (len(value), len(value[0])) if isinstance(value[0], list) else (len(value),)


def in_words(dims):
    return " x ".join(map(str, dims))


def changed(params, name, change):
    """params with the parameter name (as held names it) replaced by change(its value)."""
    if not name.startswith("blocks"):
        return dict(params, **{name: change(params[name])})
    layer, key = int(name[7:name.index("]")]), name[name.index("['") + 2:-2]
    blocks = list(params["blocks"])
    blocks[layer] = dict(blocks[layer], **{key: change(blocks[layer][key])})
    return dict(params, blocks=blocks)


def one_short(value):
    """A parameter one row or entry short."""
    return value[:-1]


def not_a_number_first(value):
    """A parameter whose first number is nan."""
    return ([[math.nan, *value[0][1:]], *value[1:]] if isinstance(value[0], list)
            else [math.nan, *value[1:]])


def quick_check():
    """Each parameter has its shape and first values; check_params refuses it one short.

    For each shape of TRIED: every parameter deep_params.init_params makes has the
    (rows, columns) worked_out gives, none more or fewer, each matrix the spread its std
    gives (its mean square within 1.5 times of std squared), each gain 1.0 and each bias
    0.0; check_params takes the params, and refuses each parameter of the first one row or
    entry short, or holding nan, naming it. Then a million layers are refused by
    check_model_shape. None if all holds, else a Wrong naming the model, the parameter and
    both shapes or values."""
    for args in TRIED:
        step(f"deep_params.init_params{args}")
        params = deep_params.init_params(*args)
        where = f"deep_params.init_params{args}, {deep_label(params)}"
        wanted, values = worked_out(params["shape"]), held(params)
        for name in sorted(set(wanted) | set(values)):
            if name not in values or name not in wanted:
                return Wrong(f"{where}: {name} is {'missing' if name in wanted else 'held'}, "
                             f"where {'a' if name in wanted else 'no'} parameter of that name "
                             f"is expected", f"  held: {sorted(values)}\n"
                                             f"  expected: {sorted(wanted)}")
            if dims_of(values[name]) != wanted[name]:
                return Wrong(f"{where}: {name} is {in_words(dims_of(values[name]))}, "
                             f"{in_words(wanted[name])} expected")
            if len(wanted[name]) == 2:   # std 0.5 for an embedding, else 1 / sqrt(rows)
                spread = 0.25 if name.endswith("_emb") else 1 / wanted[name][0]
                square = math.fsum(v * v for row in values[name] for v in row) / math.prod(
                    wanted[name])
                if not spread / 1.5 < square < spread * 1.5:
                    return Wrong(f"{where}: {name}'s numbers have a mean square of "
                                 f"{square:.4g}, about {spread:.4g} expected (drawn with a "
                                 f"std of {'0.5' if name.endswith('_emb') else '1 / sqrt(rows)'})")
            first = name.rstrip("']")[-2:]
            if first in ("_g", "_b") and set(values[name]) != {1.0 if first == "_g" else 0.0}:
                return Wrong(f"{where}: {name} holds {sorted(set(values[name]))}, "
                             f"{[1.0 if first == '_g' else 0.0]} expected (a "
                             f"{'gain' if first == '_g' else 'bias'} starts there)")
        step(f"{where}: check_params of the params init_params made")
        deep_params.check_params(params)
        for name in sorted(values) if args == TRIED[0] else ():   # one model's will do
            for change, what in ((one_short, "one short"), (not_a_number_first, "holding nan")):
                step(f"{where}: check_params of the params with {name} {what}")
                try:
                    deep_params.check_params(changed(params, name, change))
                except ValueError as refusal:
                    if name.split("[")[-1].strip("']") not in str(refusal):
                        return Wrong(f"{where}: check_params refused {name} {what} without "
                                     f"naming it: {refusal}")
                else:
                    return Wrong(f"{where}: check_params took {name} {what} (of "
                                 f"{in_words(wanted[name])}), where it should refuse it")
    step("deep_params.check_model_shape of a million layers")
    try:
        deep_params.check_model_shape(10 ** 6, 4, 4, 16, "learned", None, 0)
    except ValueError:
        return None
    return Wrong("deep_params.check_model_shape took a million layers of width 16 (billions of "
                 "numbers), where it should refuse more than MAX_NUMBERS")


QuickCheck = verdicts.quick_check_case("deep_params", __name__)


class QuickCheckTeeth(unittest.TestCase):
    """Mistakes planted in the real deep_params.py (by its syntax tree): the quick check
    names the model and the parameter each changes."""

    MISTAKES = [
        ("an MLP of 2 x width", deep_params, "param_shapes",
         swapping("(width, 4 * width)", "(width, 2 * width)"),
         r"^deep_params\.init_params\(2, 4, 2, 16, 0\), the 2-layer grouped-query model .*: "
         r"blocks\[0\]\['W1'\] is 16 x 32, 16 x 64 expected"),
        ("keys and values as wide as the queries, whatever the kv heads", deep_params,
         "param_shapes",
         swapping("shape['kv_heads'] * (shape['width'] // shape['heads'])", "shape['width']"),
         r"blocks\[0\]\['W[kv]'\] is 16 x 16, 16 x 8 expected"),
        ("a rotary key a head for the shared key", deep_params, "param_shapes",
         swapping("(width, rotary_key)", "(width, shape['heads'] * rotary_key)"),
         r"init_params\(1, 4, 4, 16, 0, 'rotary', 8\), .*: blocks\[0\]\['Wkr'\] is 16 x 8, "
         r"16 x 2 expected"),
        ("a position table for rotary models too", deep_params, "param_shapes",
         swapping("shape['positions'] == 'learned'", "True"),
         r"'rotary'\), .*: pos_emb is held, where no parameter"),
        ("gains drawn at 0.0", deep_params, "init_params",
         swapping("1.0 if name.endswith('_g') else 0.0", "0.0"),
         r": (blocks\[0\]\['ln1_g'\]|lnf_g) holds \[0\.0\], \[1\.0\] expected"),
        ("a block's shapes not checked", deep_params, "check_params",
         swapping("check_shape(block[name], wanted_dims, where)", "pass"),
         r": check_params took blocks\[0\]\['\w+'\] one short"),
        ("a std of 1 / sqrt(columns), not rows", deep_params, "drawn",
         swapping("dims[0] ** (-0.5)", "dims[1] ** (-0.5)"),
         r"init_params\(2, 4, 2, 16, 0\), .*: W_out's numbers have a mean square of \S+, "
         r"about 0\.0625 expected"),
        ("a block's values not checked", deep_params, "check_params",
         swapping("check_values(where, block[name] if len(wanted_dims) == 2 else [block[name]])",
                  "pass"),
         r": check_params took blocks\[0\]\['\w+'\] holding nan"),
        ("the numbers of one layer counted, not of every layer", deep_params,
         "check_model_shape",
         swapping("layers * sum(map(math.prod, one.pop('blocks')[0].values()))",
                  "sum(map(math.prod, one.pop('blocks')[0].values()))"),
         r"check_model_shape took a million layers")]

    def test_each_mistake_names_its_model_and_parameter(self):
        verdicts.assert_verdicts(self, "deep_params", self.MISTAKES)


class Refusals(unittest.TestCase):

    def test_a_seed_that_is_not_an_int_is_refused(self):
        """None (random.Random would seed from the clock), 1.5, True and "0" (it would take
        them): refused by name, as generate refuses them, before a weight is made."""
        for seed in (None, 1.5, True, "0"):
            with self.subTest(seed=seed), self.assertRaisesRegex(
                    ValueError, f"seed must be an int, got {re.escape(repr(seed))}"):
                deep_params.init_params(1, 4, 4, 16, seed)

    def test_shapes_too_large_to_build_are_refused_at_once(self):
        """A million layers (about 100 GB), a width of a billion, and the same sizes in a
        hand-made params' shape: refused before a weight is made, within a second."""
        params = deep_params.init_params(1, 4, 4, 16, 0)
        started = time.process_time()
        with self.assertRaisesRegex(ValueError, "more than 10,000,000"):
            deep_model.DeepCache(dict(params, shape=dict(params["shape"], layers=10 ** 12)))
        for args in ((10 ** 6, 4, 4, 16, 0), (1, 1, 1, 10 ** 9, 0), (10 ** 12, 4, 4, 16, 0)):
            with self.assertRaisesRegex(ValueError,
                                        "numbers, more than 10,000,000: give fewer layers"):
                deep_params.init_params(*args)
        self.assertLess(time.process_time() - started, 1.0)


if __name__ == "__main__":
    unittest.main()
