"""The commands, sessions and code the course's documents show, against the lab: every
`$ python3` example and Python session prints what is shown (but the seconds), every exercise's
answer does what it says in a copy of the lab's folder (its edit of the code made there),
and every excerpt is in its function."""
import doctest
import importlib
import inspect
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest

from course_map import course, exercises, the_documents, EXERCISES
from support import HERE, ON_PURPOSE, lab_file
from verdicts import skip_unless_sound

TIMES = re.compile(r"\d[\d,]*\.\d+ (s|µs)\b")   # seconds vary from run to run


def setUpModule():
    """The documents show what the code does: if a layer of the lab is wrong, its examples
    wait (the layer's own tests say what is wrong)."""
    skip_unless_sound("every Part")


def fenced_blocks(text):
    """(line number, first line, lines) of every fenced block of text."""
    return [(text[:found.start()].count("\n") + 2, found.group(1), found.group(2).splitlines())
            for found in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def mismatch(shown, printed, source="the command"):
    """None if the lines printed match the lines shown, else the first line that does not:
    times are not compared, and a line "..." in shown stands for any number of lines."""
    shown = [TIMES.sub("<seconds>", line) for line in shown]
    printed = [TIMES.sub("<seconds>", line) for line in printed]
    at, skipping = 0, False
    for line in shown:
        if line == "...":
            skipping = True
            continue
        if skipping:
            found = next((i for i in range(at, len(printed)) if printed[i] == line), None)
            if found is None:
                return f"the README shows {line!r}, which {source} does not give after line {at}"
            at, skipping = found + 1, False
        elif at >= len(printed) or printed[at] != line:
            got = printed[at] if at < len(printed) else "(nothing more)"
            return f"line {at + 1}: the README shows {line!r}, {source} gives {got!r}"
        else:
            at += 1
    if not skipping and at < len(printed):
        return f"{source} gives more than the README shows, from line {at + 1}: {printed[at]!r}"
    return None


def commands(answer):
    """The fenced blocks of an answer: ("console", its "$ " command, the lines shown) or
    ("pycon", the session's text, None)."""
    found = []
    for kind, body in re.findall(r"^```(console|pycon)\n(.*?)^```$", answer, re.M | re.S):
        lines = body.splitlines()
        found.append((kind, lines[0], lines[1:]) if kind == "console" else (kind, body, None))
    return found


def session_problems(session, name, folder=HERE):
    """Replay a Python session (>>> lines and what they print) in folder, as a learner
    typing it into python3 there: None, or what doctest reports of its first mismatch."""
    test = doctest.DocTestParser().get_doctest(session, {}, name, None, 0)
    report = io.StringIO()
    runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.REPORT_ONLY_FIRST_FAILURE)
    before = os.getcwd()
    os.chdir(folder)
    try:
        failed = runner.run(test, out=report.write).failed
    finally:
        os.chdir(before)
    return report.getvalue() if failed else None


def run_shown(command, shown, folder=HERE):
    """Run a "$ python3 ..." command in folder: None if it prints the lines shown, else
    the first line that differs."""
    done = subprocess.run([sys.executable, *shlex.split(command[len("$ python3 "):])],
                          cwd=folder, capture_output=True, text=True, timeout=120)
    return mismatch(shown, (done.stdout + done.stderr).splitlines())


class Examples(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.texts = the_documents()

    def test_every_example_prints_what_the_documents_show(self):
        """Each fenced block whose first line is "$ python3 ..." is run from the lab's
        folder, but those of the exercises (which run in a copy of it, below); training
        logs (python3 train.py) are one real run's and are tied to best.json by
        test_the_reference_quotes_the_checkpoint_figures instead."""
        answers = "".join(exercise.answer for exercise in exercises(self.texts))
        examples = [(name, line, block[0], block[1:]) for name, text in self.texts.items()
                    for line, _, block in fenced_blocks(text)
                    if block and block[0].startswith("$ python3 ")
                    and not block[0].startswith("$ python3 train.py")
                    and "\n".join(block) not in answers]
        self.assertGreaterEqual(len(examples), 2)
        for name, line, command, shown in examples:
            with self.subTest(command=command):
                found = run_shown(command, shown)
                if found:
                    self.fail(f"{name} line {line}, `{command}`: {found}.\n{ON_PURPOSE}: "
                              f"run the command and copy what it prints.")

    def test_every_session_prints_what_the_documents_show(self):
        """Each Python session outside the exercises (whose answers are replayed below) is
        replayed from the lab's folder, as a learner types it there."""
        answers = "".join(exercise.answer for exercise in exercises(self.texts))
        sessions = [(name, line, "\n".join(lines) + "\n")
                    for name, text in self.texts.items()
                    for line, kind, lines in fenced_blocks(text)
                    if kind == "pycon" and "\n".join(lines) not in answers]
        self.assertTrue(sessions)
        for name, line, session in sessions:
            with self.subTest(f"{name} line {line}"):
                found = session_problems(session, f"{name} line {line}")
                if found:
                    self.fail(f"{name} line {line}: {found}\n{ON_PURPOSE}: type it into "
                              f"python3 in the lab's folder and copy what it prints.")

    def test_each_part_ends_with_two_or_three_exercises_and_their_answers(self):
        found = exercises(self.texts)
        for part in course(self.texts):
            with self.subTest(part.name):
                self.assertRegex(re.findall(r"^#+ .*", part.text, re.M)[-1], EXERCISES,
                                 f"{part.file}: {part.name} must end with its exercises")
                asked = [exercise for exercise in found if exercise.part == part.name]
                self.assertIn(len(asked), (2, 3), f"{part.name}: 2 or 3 exercises")
                for exercise in asked:
                    self.assertTrue(commands(exercise.answer), f"{exercise.file} line "
                                    f"{exercise.line}, {exercise.title!r}: its answer must "
                                    f"show a command or a session that a test runs")

    def test_every_answer_prints_what_it_shows(self):
        """Each exercise's answer is run as a learner would: its commands in a copy of the
        lab's folder (with the exercise's edit of the code made there, if it asks for
        one), one after another, and its Python sessions replayed there."""
        for exercise in exercises(self.texts):
            where = f"{exercise.file} line {exercise.line}, exercise {exercise.title!r}"
            with self.subTest(exercise.title), tempfile.TemporaryDirectory() as folder:
                for name in os.listdir(HERE):
                    if os.path.isfile(os.path.join(HERE, name)):
                        shutil.copy(os.path.join(HERE, name), folder)
                if exercise.edit:   # made for its commands: a session imports the lab's
                    self.assertNotIn("pycon", [kind for kind, _, _ in commands(exercise.answer)],
                                     f"{where}: an edit of the code is tried by commands")
                    name, old, new = exercise.edit
                    code = lab_file(name)
                    self.assertEqual(code.count(old), 1, f"{where}: `{old}` must be in "
                                     f"{name} once, to be changed")
                    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                        f.write(code.replace(old, new))
                for kind, command, shown in commands(exercise.answer):
                    found = (run_shown(command, shown, folder) if kind == "console"
                             else session_problems(command, exercise.title, folder))
                    if found:
                        self.fail(f"{where}: {found}\n{ON_PURPOSE}: run it and copy what it "
                                  f"prints.")

    def test_the_documents_show_the_real_code(self):
        excerpts = [(name, *found) for name, text in self.texts.items() for found in
                    re.findall(r"<!-- excerpt: (\w+)\.(\w+) -->\n```python\n(.*?)```", text,
                               re.DOTALL)]
        self.assertGreaterEqual(len(excerpts), 2)
        for name, module, function, code in excerpts:
            with self.subTest(excerpt=f"{module}.{function}"):
                source = inspect.getsource(getattr(importlib.import_module(module), function))
                self.assertTrue(code in source, f"{name}'s excerpt of {module}.{function} is "
                                f"not in its source any more. {ON_PURPOSE}: copy the lines "
                                f"again.")

    def test_a_line_shown_must_match_except_times_and_elided_lines(self):
        printed = ["uncached: 198 rows, 0.067 s", "a", "b", "c", "identical: yes"]
        self.assertIsNone(mismatch(["uncached: 198 rows, 1.234 s", "...", "identical: yes"],
                                   printed))
        self.assertIn("line 1", mismatch(["uncached: 225 rows, 0.067 s", "..."], printed))
        self.assertIn("gives more", mismatch(printed[:3], printed))
        self.assertIn("does not give", mismatch(["...", "identical: NO"], printed))


if __name__ == "__main__":
    unittest.main()
