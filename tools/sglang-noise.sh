# Sourced by tools/quickstart.sh and bench/run.sh. SGLang on CPU writes start-up chatter to stderr (warnings, CUDA
# arch and AMX notices, ...) that says nothing about the plugin or the result: drop_sglang_noise filters those lines
# out of a stream, so what is left is worth reading.
drop_sglang_noise() { grep -vE "[Ww]arn|CUDA arch|AMX|chunked prefill|DEEPEP|return func"; }
