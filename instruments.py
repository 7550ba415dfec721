"""The lab's instruments: what its experiments, its tests and kv_cache.py --show use to
watch the code run, without changing the code they watch.

recording(module, name) sees every call of module.name (its arguments and what it
returned) while the real function runs as usual; replaced(module, name, stand_in) swaps it
for a while; largest_gap compares two lists of rows; sums_in_another_order makes every sum
of the model a plain left-to-right one, last term first; plant(owner, name, mistake)
compiles a function of the lab again from its real source with a mistake planted in its
syntax tree, which is how the tests show they have teeth; where_raised names the lines
of the lab an exception came through, for a message of one line; count_reads counts the
distinct numbers a step reads from memory (the weights and the cache); reusing hands
model.forward's recorded results back for inputs it has already run (passes_by_input).
"""
import ast
import contextlib
import functools
import inspect
import operator
import os
import sys
import textwrap
import traceback
import types
from collections import namedtuple

import model

Call = namedtuple("Call", "name args result")
Call.__doc__ = """One recorded call: the function's name, its positional arguments (and
keyword arguments as a last dict, if any were given), and what it returned. The
arguments are the objects passed, not copies: a list the caller changes later (the token
IDs of a generation) shows its later state."""


@contextlib.contextmanager
def replaced(module, name, stand_in):
    """Inside this block, module.name is stand_in(real), where real is the original."""
    real = getattr(module, name)
    setattr(module, name, stand_in(real))
    try:
        yield
    finally:
        setattr(module, name, real)


@contextlib.contextmanager
def recording(module, *names):
    """Inside this block, record every call of module.name, for each of names, as a Call.

    Each call is appended, as it returns, to the list the block yields: what the code
    really computed, seen without running it again. A call that raises is not recorded.
    Calls that another function makes through the module's global name are seen too
    (kv_cache.feed calls forward_step so)."""
    calls = []

    def keeping(name):
        def stand_in(real):
            @functools.wraps(real)
            def wrapper(*args, **kwargs):
                result = real(*args, **kwargs)
                calls.append(Call(name, args + ((kwargs,) if kwargs else ()), result))
                return result
            return wrapper
        return stand_in
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(replaced(module, name, keeping(name)))
        yield calls


def results(calls):
    """What each recorded call returned, in order."""
    return [call.result for call in calls]


def reusing(params, passes):
    """Inside this block, model.forward gives the results passes holds instead of computing them.

    A context manager. passes maps a tuple of token IDs to forward's result on params and
    those IDs; with passes empty, nothing changes. forward's result depends on its
    arguments alone (test_model), so the sampled run, wherever its story has chosen the
    greedy one's tokens so far, is given the very full passes the greedy run made."""
    if not passes:
        return contextlib.nullcontext()

    def stand_in(real):
        def forward(given, ids, *rest, **named):
            found = passes.get(tuple(ids)) if given is params and not (rest or named) else None
            return real(given, ids, *rest, **named) if found is None else found
        return forward
    return replaced(model, "forward", stand_in)


def passes_by_input(story, full_passes):
    """The recorded full passes of one uncached generation of story, by the token IDs each read.

    story is its token IDs; the result is reusing's passes: pass n read the prompt and n
    chosen tokens."""
    return {tuple(story[:len(story) - len(full_passes) + n]): call.result
            for n, call in enumerate(full_passes)}


def largest_gap(rows, other_rows):
    """The largest difference between corresponding logits of two lists of rows.

    The two lists must be equally long."""
    if len(rows) != len(other_rows):
        raise ValueError(f"{len(rows)} rows cannot be compared with {len(other_rows)}")
    return max((abs(a - b) for row, other in zip(rows, other_rows) for a, b in zip(row, other)),
               default=0.0)


def sums_in_another_order():
    """Inside this block the model adds its terms one by one, last term first.

    A context manager; the terms are added so instead of with one correctly rounded fsum:
    the same numbers, summed in another order."""
    return replaced(model, "fsum", lambda exact: lambda terms: functools.reduce(
        operator.add, reversed(list(terms)), 0.0))


def chosen_rows(calls):
    """The rows that chose each token, from recorded calls of generate.Generation.choose.

    Each is (the generation, the position of the row whose logits chose the token, those
    logits), in order. The k-th choice of a generation is made by the row of position
    (prompt tokens - 1) + k."""
    made = {}
    chosen = []
    for call in calls:
        generation, logits = call.args
        k = made[id(generation)] = made.get(id(generation), -1) + 1
        prompt_tokens = len(generation.ids) - len(generation.steps)
        chosen.append((generation, prompt_tokens - 1 + k, logits))
    return chosen


def plant(owner, name, mistake):
    """owner.name compiled again from its real source with a mistake planted in its syntax tree.

    owner.name is a module's function, or a class's method that does not call super(); it
    reads its module's own globals, as an edit of the file would. None if the spot is gone
    (an edit removed it). mistake(tree) changes the tree and returns how many places it
    changed, so comments, blank lines, formatting and most renamings leave planting intact.
    Patch it in (unittest.mock.patch.object(owner, name, planted)) to try it."""
    real = getattr(owner, name)
    lines, first_line = inspect.getsourcelines(real)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    if not mistake(tree):
        return None
    ast.increment_lineno(tree, first_line - 1)   # a traceback points into the real file
    module_globals = vars(sys.modules[real.__module__])
    namespace = dict(module_globals)
    exec(compile(ast.fix_missing_locations(tree), inspect.getsourcefile(real), "exec"),
         namespace)
    compiled = namespace[name]
    return types.FunctionType(compiled.__code__, module_globals, name,
                              compiled.__defaults__, compiled.__closure__)


def replacing(matches, replacement):
    """A mistake for plant that replaces nodes.

    Every node for which matches(node) holds becomes replacement(node)."""
    def mistake(tree):
        changed = 0

        class Planter(ast.NodeTransformer):
            def visit(self, node):
                nonlocal changed
                self.generic_visit(node)
                if matches(node):
                    changed += 1
                    return replacement(node)
                return node
        Planter().visit(tree)
        return changed
    return mistake


def is_call_of(node, name, arguments=None):
    """Whether node (of a syntax tree) is a call of the function name, name(...).

    With that many positional arguments if arguments is given: what plantings look for."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == name and (arguments is None or len(node.args) == arguments))


def spelt(node, source):
    """Whether node (of a syntax tree) is source, as ast.unparse spells it.

    What a planting looks for beside a condition of its own (support.swapping, where it
    needs none)."""
    return ast.unparse(node) == source


class _Watched(list):
    """A vector of floats that notes which of its entries are read: all of them when it
    is iterated, joined to another list or repeated; some when it is indexed or sliced."""

    def __init__(self, values, touched):
        super().__init__(values)
        self.touched = touched

    def _note(self, indices):
        self.touched.setdefault(id(self), set()).update(indices)

    def __iter__(self):
        self._note(range(len(self)))
        return super().__iter__()

    def __getitem__(self, index):
        read = range(len(self))[index]
        self._note(read if isinstance(index, slice) else [read])
        return super().__getitem__(index)

    def __add__(self, other):
        self._note(range(len(self)))
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __mul__(self, times):
        self._note(range(len(self)))
        return list.__mul__(self, times)


def count_reads(step, *holders):
    """The number of distinct entries that step() reads from the vectors inside holders.

    Vectors are lists of floats, found by walking holders (dicts and lists); each entry
    counts once however often it is read, as a kernel that loads it once would: the numbers
    a step takes from memory. Every vector is replaced in place by one that watches its
    reads, and stays so: pass what only this count uses (a model and a cache made for
    it)."""
    touched = {}

    def watch(holder):
        keys = holder.keys() if isinstance(holder, dict) else range(len(holder))
        for key in keys:
            value = holder[key]
            if isinstance(value, list) and value and all(type(x) is float for x in value):
                holder[key] = _Watched(value, touched)
            elif isinstance(value, (dict, list)):
                watch(value)
    for holder in holders:
        watch(holder)
    step()
    return sum(map(len, touched.values()))


LAB = os.path.dirname(os.path.abspath(__file__))


def where_raised(error):
    """The last three lines of the lab's own modules (not its tests) an exception came through.

    As " (in serving.py line 136, admit; ...)", or "" if none."""
    frames = [f"{os.path.basename(frame.filename)} line {frame.lineno}, {frame.name}"
              for frame in traceback.extract_tb(error.__traceback__)
              if os.path.dirname(os.path.abspath(frame.filename)) == LAB
              and not os.path.basename(frame.filename).startswith(("test_", "support",
                                                                   "verdicts"))]
    return f" (in {'; '.join(frames[-3:])})" if frames else ""
