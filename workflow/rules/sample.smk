rule sample:
    input:
        out(dw.EXPORT_OUTPUTS[dw.sample_format(CFG)]),
    output:
        directory(out(paths.SAMPLES_DIR)),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "sample"),
    log:
        out("logs/sample.log"),
    benchmark:
        out("benchmarks/sample.tsv")
    shell:
        "diffpipe sample --config {params.config:q} > {log:q} 2>&1"
