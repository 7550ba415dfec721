"""What trace_kv.py needs to share a run's stages among processes, and nothing of the lab:
a result pickled once for every worker (Shipped), a stand-in pool that runs each task at
once in this process (Here), and a pool's end that never waits for ever (stop)."""
import pickle
from concurrent.futures import Future

STOP_SECONDS = 5   # how long a terminated worker has to end before it is killed


class Shipped:
    """A stage's result on its way to the workers, pickled once here.

    Each worker unpickles it once, however many cases need it (the runs' rows and weights,
    about 3 MB, would cost some 20 ms a case)."""
    received = {}   # in a worker (which serves one run): each result by its stage's name

    def __init__(self, name, value):
        self.name, self.data = name, pickle.dumps(value, pickle.HIGHEST_PROTOCOL)

    def value(self):
        if self.name not in self.received:
            self.received[self.name] = pickle.loads(self.data)
        return self.received[self.name]


class Here:
    """Runs every task in this process as it is submitted (--workers 1).

    It answers as a process pool would, on the lab already loaded."""

    def submit(self, function, *args):
        future = Future()
        future.set_result(function(*args))
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def stop(pool):
    """End a pool at once, its running stages too.

    Cancel what has not started, terminate its workers, and kill any still alive a few
    seconds later (never wait for ever)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())   # public in 3.14
    for worker in workers:
        worker.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.join(STOP_SECONDS)
        if worker.is_alive():
            worker.kill()
            worker.join()
