rule train:
    input:
        latents=planned(paths.LATENT_SHARD, "latents"),
        text=planned(paths.TEXT_SHARD, "text"),
        empty=out(paths.TEXT_EMPTY),
    output:
        adapter=out(paths.ADAPTER_FILE),
        metrics=out(paths.METRICS),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "train"),
    resources:
        gpu=1,
    log:
        out("logs/train.log"),
    benchmark:
        out("benchmarks/train.tsv")
    shell:
        "diffpipe train --config {params.config} --processes {resources.gpu} > {log} 2>&1"
