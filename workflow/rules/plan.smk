# update(): Snakemake must not delete the plan folder before the job. The plan rewrites
# only the spec files whose content changed, so an unchanged shard's spec keeps its mtime
# and its cache job does not rerun. Deleted first, every spec came back newer than its
# shard, and only Snakemake's input checksums (of files under 1 MB) saved the shards:
# a spec of a few thousand items is larger, and then any edit rebuilt every shard.
checkpoint plan:
    input:
        out(paths.MANIFEST),
    output:
        update(directory(out(paths.PLAN_DIR))),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "plan"),
    log:
        out("logs/plan.log"),
    benchmark:
        out("benchmarks/plan.tsv")
    shell:
        "diffpipe plan --config {params.config:q} > {log:q} 2>&1"
