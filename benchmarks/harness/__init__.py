"""The benchmark harness: what every run of ``python -m benchmarks NAME`` shares.

    paths      where models, data, results and the cache live in the checkout
    flags      a run's flags from its settings dataclass (services.common.settings), engine
               fields embedded from the engine's own configs
    engine     the in-process engine as the runs build it, and the executor/scheduler flags
               that give the services exactly the same settings
    launch     the four services started for a run (quiet logs, thread count, metrics ports)
    client     one Generate stream read into a RequestRecord
    records    what a streamed request recorded, and the statistics over many
    stats      percentiles and medians
    scrape     a service's /metrics samples, and counters moved over a run
    cpu        CPU seconds, resident memory and threads of processes (/proc)
    bursts     bursts of Generate calls against a full server, each refusal timed
    child      a function of a run in a child process of its own
    hf         the Hugging Face baseline model, loaded to do the same work
    models     model directories of the runs (random-weight models built into the cache)
    step_codec what one step costs through the codec and the wire format
    report     the result file: command, commit, machine, load average, figures

Torch-free except engine, hf and models' random-model build (imported when a run needs them).
"""
