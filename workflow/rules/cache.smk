# One job per shard. A spec file changes only when its entries' keys change,
# so an edit rebuilds only the shards it touches; a rebuilt shard copies the
# entries the content-addressed store (cache.dir) already holds and encodes
# only the missing ones. DIFFPIPE_REGENERATE=1 / DIFFPIPE_TRUST=1 in the
# environment act as --regenerate / --trust (never params: they would rerun jobs).


rule cache_latents:
    input:
        plan_file(paths.LATENT_SPEC),
    output:
        directory(out(paths.LATENT_SHARD)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "cache"),
    resources:
        gpu=1,
    log:
        out("logs/cache_latents/{shard}.log"),
    benchmark:
        out("benchmarks/cache_latents/{shard}.tsv")
    shell:
        "diffpipe cache latents --config {params.config:q} --shard {wildcards.shard:q} > {log:q} 2>&1"


rule cache_text:
    input:
        plan_file(paths.TEXT_SPEC),
    output:
        out(paths.TEXT_SHARD),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "cache"),
    resources:
        gpu=1,
    log:
        out("logs/cache_text/{shard}.log"),
    benchmark:
        out("benchmarks/cache_text/{shard}.tsv")
    shell:
        "diffpipe cache text --config {params.config:q} --shard {wildcards.shard:q} > {log:q} 2>&1"


rule cache_empty_text:
    input:
        plan_file(paths.EMPTY_SPEC),
    output:
        out(paths.TEXT_EMPTY),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "cache"),
    resources:
        gpu=1,
    log:
        out("logs/cache_empty_text.log"),
    benchmark:
        out("benchmarks/cache_empty_text.tsv")
    shell:
        "diffpipe cache empty --config {params.config:q} > {log:q} 2>&1"
