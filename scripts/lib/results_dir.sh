# Sourced by the scripts that write microbench results. grpo_results_dir
# prints microbench/results/<machine>, the folder this machine's results go to
# (microbench/results/README.md: one folder per machine). <machine> is the CPU
# model from /proc/cpuinfo, lower case and hyphenated, without the vendor, the
# (R)/(TM) marks, "CPU"/"Processor" and the clock, plus "-amx" when the CPU
# has AMX-BF16: "Intel(R) Xeon(R) Processor" with amx_bf16 -> xeon-amx.
# "unknown-cpu" when there is no model name.
grpo_results_dir() {
  local model flags slug
  model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)
  flags=$(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)
  slug=$(printf '%s' "$model" | tr '[:upper:]' '[:lower:]' |
    sed -E 's/\((r|tm)\)//g; s/@.*$//; s/(^| )(intel|amd|cpu|processor)( |$)/ /g; s/(^| )(intel|amd|cpu|processor)( |$)/ /g;
            s/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
  [[ -n $slug ]] || slug=unknown-cpu
  if [[ " $flags " == *" amx_bf16 "* ]]; then slug="$slug-amx"; fi
  echo "microbench/results/$slug"
}
