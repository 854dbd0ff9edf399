rule train:
    input:
        latents=planned(paths.LATENT_SHARD, "latents"),
        text=planned(paths.TEXT_SHARD, "text"),
    output:
        adapter=out(paths.ADAPTER_FILE),
        metrics=out(paths.METRICS),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "train"),
    resources:
        gpus=1,
    log:
        out("logs/train.log"),
    benchmark:
        out("benchmarks/train.tsv")
    shell:
        "diffpipe train --config {params.config} --processes {resources.gpus} > {log} 2>&1"
