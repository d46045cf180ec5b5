"""kerasmulti.launch() from a process that has not run TensorFlow, as a notebook would.

`notebook_launch.py ok`: two workers train, each returns its weights; prints
"same weights" when they agree. `notebook_launch.py fail`: worker 1 raises;
`notebook_launch.py unloadable`: the workers return a value that cannot be
unpickled here; `unpicklable`: one that cannot be pickled there (a lambda). Each
prints the error launch() raised. `notebook_launch.py sigterm FOLDER`: worker 1
gets SIGTERM at its third batch, with a ParallelBackupAndRestore in FOLDER.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import os
import signal
import sys

import kerasmulti


def _refuse():
    raise ValueError("this value cannot be rebuilt")


class Unloadable:
    def __reduce__(self):  # pickles in the worker, fails to unpickle here
        return _refuse, ()


def train(mode):
    if mode == "unloadable":
        return Unloadable()
    if mode == "unpicklable":
        return lambda: "a function cannot be sent back"
    import keras
    import numpy as np

    index = kerasmulti._src.cluster.config()["task"]["index"]
    print(f"training in worker {index}", flush=True)
    if mode == "fail" and index == 1:
        raise ValueError("worker 1 broke on purpose")
    keras.utils.set_random_seed(index)  # different starts: the chief's weights win
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    parallel = kerasmulti.parallelize(model)
    parallel.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(index)  # different data: only an all-reduce keeps them equal
    callbacks = []
    if mode == "sigterm":  # worker 1 is preempted at its third batch: both back up that step

        class Preempted(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 2 and index == 1:
                    os.kill(os.getpid(), signal.SIGTERM)

        callbacks = [Preempted(), kerasmulti.ParallelBackupAndRestore(sys.argv[2])]
    parallel.fit(rng.normal(size=(32, 4)), rng.normal(size=(32, 1)), batch_size=8, verbose=0, callbacks=callbacks)
    return model.get_weights()


if __name__ == "__main__":
    mode = sys.argv[1]
    try:
        results = kerasmulti.launch(train, args=(mode,), workers=2)
    except kerasmulti.ClusterError as error:  # a RuntimeError
        print(f"launch raised: {error}", flush=True)
        sys.exit(0)
    import numpy as np

    same = all(np.array_equal(a, b) for a, b in zip(*results))
    print("same weights" if same and len(results) == 2 else "different weights", flush=True)
