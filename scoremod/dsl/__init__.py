"""The score_mod DSL: IR, op table, tracing, text form, derivatives."""
