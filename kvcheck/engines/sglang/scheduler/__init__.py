"""SGLang's own `Scheduler` on CPU: the scheduler drive (layouts `NAME@sched`).

SGLang's scheduler class runs here as it runs in a server, minus its processes: requests enter
through `handle_generate_request` (SGLang builds its own `Req` from a `TokenizedGenerateReqInput`
with real `SamplingParams`), each step is the normal event loop's body (`get_next_batch_to_run`
-> `run_batch` -> `process_batch_result`, or `on_idle` with its own self-checks), aborts go
through `abort_request`. Admission, chunking, retraction, the cache calls and their order are
SGLang's. kvcheck supplies the model worker (`worker.py`: sampled tokens from the seeded
generator, and the checks of what each forward reads and writes) and the pieces that need a GPU,
a process group or a socket (`build.py`, each said there).
"""
