rule validate:
    input:
        dw.dataset_inputs(CFG),
    # update(): Snakemake must not delete the previous manifest before the job,
    # it is what lets validation skip files whose size and mtime are unchanged.
    output:
        manifest=update(out(paths.MANIFEST)),
        report=update(out(paths.REPORT_JSON)),
        html=update(out(paths.REPORT_HTML)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "validate"),
    log:
        out("logs/validate.log"),
    benchmark:
        out("benchmarks/validate.tsv")
    shell:
        "diffpipe validate --config {params.config} > {log} 2>&1"
