# The run report: one self-contained HTML page of what the run produced (diffpipe.report). Its inputs
# are what it shows, so it reruns after any stage it reports on; it reads the config training ran
# with from the run (train/config.yaml), and only `sample` (the prompts under the images) from today's.


rule report:
    input:
        validation=out(paths.REPORT_JSON),
        metrics=out(paths.METRICS),
        exports=list(dw.export_outputs(CFG).values()),
        samples=out(paths.SAMPLES_DIR),
    output:
        report(
            out(paths.RUN_REPORT),
            caption="../report/run_report.rst",
            category="Run report",
        ),
    params:
        config=RESOLVED,
        digest=dw.stage_digest(CFG, "report"),
    log:
        out("logs/report.log"),
    benchmark:
        out("benchmarks/report.tsv")
    shell:
        "diffpipe report --config {params.config:q} > {log:q} 2>&1"
