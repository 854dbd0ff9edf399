# One job per shard. A spec file changes only when its items' content changes,
# so an edit re-encodes only the shards it touches.


rule cache_latents:
    input:
        out(paths.LATENT_SPEC),
    output:
        directory(out(paths.LATENT_SHARD)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "cache"),
    resources:
        gpus=1,
    log:
        out("logs/cache_latents/{shard}.log"),
    benchmark:
        out("benchmarks/cache_latents/{shard}.tsv")
    shell:
        "diffpipe cache latents --config {params.config} --shard {wildcards.shard} > {log} 2>&1"


rule cache_text:
    input:
        out(paths.TEXT_SPEC),
    output:
        out(paths.TEXT_SHARD),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "cache"),
    resources:
        gpus=1,
    log:
        out("logs/cache_text/{shard}.log"),
    benchmark:
        out("benchmarks/cache_text/{shard}.tsv")
    shell:
        "diffpipe cache text --config {params.config} --shard {wildcards.shard} > {log} 2>&1"
