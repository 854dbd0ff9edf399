# `diffpipe run -c CFG --target bench`: the speed and memory sweep of the config's `bench:` section
# (not part of `all`). With bench.data: cache it trains on the run's caches, so they are built first.
BENCH_CACHES = CFG.bench.data == "cache"


rule bench:
    input:
        latents=planned(paths.LATENT_SHARD, "latents") if BENCH_CACHES else [],
        text=planned(paths.TEXT_SHARD, "text") if BENCH_CACHES else [],
    output:
        summary=out("bench/runs_summary.csv"),
        plot=out("bench/throughput_vs_memory.png"),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "bench"),
    # gpu: the sweep's points run one at a time, each on one device.
    resources:
        gpu=1,
    log:
        out("logs/bench.log"),
    shell:
        "diffpipe bench --config {params.config:q} > {log:q} 2>&1"
