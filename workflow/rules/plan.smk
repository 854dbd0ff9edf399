checkpoint plan:
    input:
        out(paths.MANIFEST),
    output:
        directory(out(paths.PLAN_DIR)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "plan"),
    log:
        out("logs/plan.log"),
    benchmark:
        out("benchmarks/plan.tsv")
    shell:
        "diffpipe plan --config {params.config:q} > {log:q} 2>&1"
