#!/usr/bin/env bash
# What runs on the lent H200 (see docs/cuda.md): `bash scripts/h200.sh STAGE...`, run from the
# repository root with the wheels in .whl (carried) and $OUT set. Stages:
#   tests     the gpu-marked tests (TESTS="files" for some)  -> $OUT/gpu-tests.txt
#   kbench    kernel microbenchmarks                        -> $OUT/bench.md
#   katt      the prompt-attention rows alone (cuBLAS path and flash kernel) -> $OUT/katt.md
#   kmoe      grouped MoE prefill at 2,048 / 8,704 / 16,384 tokens, its GEMMs alone -> $OUT/kmoe.md
#   m8 / m48  make the Qwen3-30B-A3B-shaped model (8 / 48 layers) in models/ (git-ignored)
#   b8        A/B + automatic planner, 8 layers, 8,192 tokens -> $OUT/b8.md
#   tg        decode speed: 48 layers, 8 GiB, 2,048-token prompt, 128 new tokens, with and
#             without MTP speculation (token graph on)                -> $OUT/tg.md
#   dtrace    decode trace on the 8-layer model: 2,048 / 31,258 random prompt tokens, 96 new,
#             with and without MTP speculation: the token graph's GPU ms per step -> stdout
#   gprof     the token graph's step by part (48 layers or GPROF_MODEL, 1 row, positions 2,048
#             and 31,000)
#             -> $OUT/gprof.md
#   mphase    prefill phases with the MoE split (route, fetch+decode, gemm), 8 layers, 16k tokens
#   prof      cProfile of `strata run` on the 48-layer model     -> $OUT/prof.txt
#   pprof     cProfile of `strata run` with a 31,258-token prompt (loan on), 8 new tokens:
#             the host's share of the prefill               -> $OUT/pprof.txt
#   vtests    the whole-process --vram-limit tests with the backend/engine ones -> $OUT/vram-tests.txt
#   vram      --vram-limit 8GiB on the 48-layer model (after m48): strata run on 31,258 tokens with
#             the loan (its budget line, STRATA_TRACE memory lines, the NVML peak), then the
#             automatic planner's table with its GPU peak column     -> $OUT/vram.md
#   cmp31     the engine before a change (BASE=dir holding its engine/ and app/, e.g. a
#             `git archive` carried under out/) against this tree: A/B at 31,258 tokens, 48
#             layers, 8 GiB, one process per side and round, sides interleaved (ROUNDS, default
#             2; BASE_LIMIT / NEW_LIMIT: each side's --vram-limit, default 8GiB: a limit that
#             caches every expert on both sides compares the code alone); each side's runs pooled with bench --merge
#             -> $OUT/cmp31.md
#   b31 / b72 automatic planner (+ A/B at 31k), 48 layers, 8 GiB, 31,258 / 72,061 tokens
#             -> $OUT/b31.md, b72.md (each run's prefill phases too: STRATA_TRACE=1);
#             ONLY=auto or ONLY=ab runs one of the two tables (a call is at most 10 minutes)
#   cmpdemo   the demo before a change (BASE as for cmp31) and after: --mtp --spec 2, 2,048
#             tokens, the loan off / on at 256-token chunks and the automatic planner, 64 new;
#             every reply's CRC                                    -> $OUT/cmpdemo.md
#   lever     one lever against its absence on the 48-layer file at 8 GiB, 31,258 tokens (or
#             LEVER_TOKENS): LEVER_A / LEVER_B flag sets (default --dense float / --dense
#             quant), the automatic planner loan off and on, MAX_NEW tokens (default 128 here),
#             ROUNDS rounds (default 1) of one process per side, sides interleaved; the reply
#             CRCs of every run (greedy: all equal) -> $OUT/lever.md
#   d31       decode at depth 31k: --mtp --spec 2 loan off / on and no MTP (`--scenario auto
#             --scenario plain`), RUNS (default 3) runs of MAX_NEW_D31 (default 256) tokens, 48
#             layers, 8 GiB                                          -> $OUT/d31.md
#   cpol      the expert cache's admission policy (docs/expert-cache.md): plain decoding (no
#             MTP) at depth 31k, 48 layers, 8 GiB, `--cache-policy static` against `adaptive`,
#             ROUNDS (default 2) rounds of one process per side, sides interleaved, MAX_NEW_D31
#             (default 256) tokens; reply CRCs (greedy: all equal)          -> $OUT/cpol.md
#   dec31     issue 32's table: decode at depth 31k (48 layers, 8 GiB, --kv q4_0, after m48) on
#             sampled text (T 1.0, seed 1) and greedy, no MTP and --mtp --spec 2, the expert
#             cache static and adaptive (`bench --scenario decode`, one run each, MAX_NEW_D31
#             tokens, default 256); each table with hit rate, link MiB / token and the drafted
#             share; the token graph's lines                     -> $OUT/dec31.md
#   ident     greedy identity on the 48-layer file (issue 18): 31,258 tokens, 64 new, the loan off
#             and on with a 4,096-token chunk (`--scenario ab`) and with the automatic planner's
#             chunks; every reply's CRC must be the same           -> $OUT/ident.md
#   mix       issue 26: the 48-layer preset in llama.cpp's Q4_K_M mix (make-model --mix q4_k_m,
#             models/q48km.gguf): its type mix, the automatic planner loan off / on at 31,258
#             tokens (RUNS_MIX, default 1), then plain decoding at depth 31k on sampled text
#             (--temperature 1.0 --seed 1, 256 tokens); with a llama-bench from `lbuild` (or
#             LLAMA_BENCH=path), llama.cpp on the same file (llama_mix below; `lmix` alone)
#                                                                         -> $OUT/mix.md
#   lbuild    llama.cpp's llama-bench and llama-speculative-simple with CUDA for sm_90, static, from
#             .llama-src/llama.cpp-$LLAMA_VER.tar.gz (LLAMA_VER default: the newest there; `bash
#             scripts/llama_src.sh [VERSION]` here; carry .llama-src) into .llama-build/, about 3
#             minutes on 16 cores; a fresh machine's tree lacks it: `lbuild mix` in one call -> lbuild.log
#   mglm      the full-size glm4.5-air preset (46 layers, 128 experts, nextn; 59.1 GiB) at $GLM_MODEL
#             (default /dev/shm/glm.gguf where /dev/shm has room, else models/glm.gguf); the next
#             call must follow at once (the machine goes back ~30 s after a call)
#   glm       issue 31's table on $GLM_MODEL (after mglm; lbuild for llama.cpp's rows): strata's
#             automatic planner loan off / on at 31,258 tokens inside --vram-limit 8GiB and 16GiB
#             (--mtp --spec 2 --kv q4_0), sampled decode at depth 31k (T 1.0, seed 1, loan on), then
#             llama.cpp on the same file (-ot exps=CPU, mapped, no repack: the repacked copy would not
#             fit beside the file in host memory): pp31258, tg32 at depth 31,258, and its MTP drafts
#             (llama-speculative-simple --spec-type draft-mtp --spec-draft-n-max 2, T 1.0 and 0); in
#             the order strata 8 GiB, llama-bench, strata 16 GiB, decode, llama.cpp's drafts (a call
#             cut short keeps the first); `lbuild & mglm` then `glm` fits one call -> $OUT/glm.md.
#             Env: GLM_LIMITS (8GiB) and GLM_LATER_LIMITS (16GiB) before / after llama-bench,
#             GLM_LLAMA_BENCH= skips it, GLM_TG_LIMIT (8GiB), GLM_PLAIN_LIMITS (none: limits
#             without --mtp, last), GLM_LLAMA_TEMPS ("1.0 0")
#   fc        the loan forecast against measured prefill (docs/forecast.md): 48 layers, 8 GiB,
#             8,192 / 31,258 / 72,061 tokens (SIZES=...), loan off, startup and repeat loan,
#             from the GPU's default rates on       -> $OUT/forecast.md, forecast.json
#   adec      the app's decode speed against `strata run` (docs/app-decode.md): demo 256 (RUNS_ADEC,
#             default 3), random-demo 256 and 1,024 (5 runs)                 -> $OUT/adec.md
#   train     the demo model (docs/demo-model.md): python -m training build, the WordNet .deb carried
#             as .whl/wordnet-base.deb, TRAIN_MINUTES (default 5.5) of training (TRAIN_FLAGS: more
#             build flags, e.g. --compile; `python3 -m training pace` times the variants); the GGUF comes
#             back in 15 MiB parts (a file from $OUT is at most 16 MiB: `cat demo.gguf.part.* >
#             engine/assets/demo.gguf`, check demo.sha256), the loss log and build record too
#                                                         -> $OUT/demo.gguf.part.*, $OUT/train/
#   adec48    the same on the 48-layer file (after m48) at --vram-limit 8GiB, 256 tokens, RUNS_ADEC
#             runs                                                    -> $OUT/adec48.md
set -euo pipefail
# once a machine: stages may run side by side (`h200.sh lbuild & h200.sh mglm`) after one install
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
export PYTHONPATH=/tmp/site:. STRATA_CACHE_DIR=/tmp/sc
OUT=${OUT:-out}
RUNS=${RUNS:-2}
MAX_NEW=${MAX_NEW:-512}
mkdir -p models "$OUT"
strata() { python3 -m engine.cli "$@"; }
p31k() {  # 31,258 random token ids (seed 31) in /tmp/p31k.txt, the prompt of every 31k row
  [ -f /tmp/p31k.txt ] || python3 -c "import random; r=random.Random(31); \
print(' '.join(str(r.randrange(1000, 150000)) for _ in range(31258)))" > /tmp/p31k.txt
}
# llama-bench's pp31258 (flags $4) then tg at depth 31,258 (flags $5) with $3 (llama-bench), the
# table rows appended to $OUT/$2, its log in $OUT/$1.log, the GPU's peak over both in $OUT/$1-peak.txt
llama_pp_tg() {
  local name=$1 md=$2 lb=$3 pp=$4 tg=$5 peak
  python3 scripts/gpu_peak.py "$OUT/$name-peak.txt" &
  peak=$!
  "$lb" $pp -p 31258 -n 0 2>"$OUT/$name.log" | grep -E "^\| (model|-|qwen|glm)" | tee -a "$OUT/$md"
  "$lb" $tg -p 0 -d 31258 2>>"$OUT/$name.log" | grep -E "^\| (qwen|glm)" | tee -a "$OUT/$md"
  kill $peak; wait $peak 2>/dev/null || true
  echo "llama.cpp GPU peak: $(cat "$OUT/$name-peak.txt") MiB (NVML, both runs)" | tee -a "$OUT/$md"
}
# llama.cpp on the strip-mtp copy of models/q48km.gguf (the `mix` stage's second half; `lmix` alone):
# experts in host memory (-ot exps=CPU), read into its own buffers (-mmp 0; mapped, -mmp 1, is
# slower), flash attention, q4_0 KV, ubatch 8,192: pp31258, then tg64 at depth 31,258, GPU peak.
llama_mix() {
  local lb=${LLAMA_BENCH:-.llama-build/bin/llama-bench}
  if [ ! -x "$lb" ]; then
    echo "llama.cpp: no llama-bench (run the lbuild stage first)" | tee -a "$OUT/mix.md"; return
  fi
  [ -f models/q48km-nomtp.gguf ] || strata strip-mtp models/q48km.gguf models/q48km-nomtp.gguf >/dev/null
  local common="-m models/q48km-nomtp.gguf -ngl 99 -ot exps=CPU -fa 1 -ctk q4_0 -ctv q4_0 -ub 8192 -b 8192 -r 2 -o md"
  llama_pp_tg llama mix.md "$lb" "$common -mmp ${LLAMA_MMP:-0}" "$common -mmp 0 -n 64"
}
# issue 31's glm4.5-air file: in /dev/shm where it has room (the disk is 64 GiB), else models/
if [ -z "${GLM_MODEL:-}" ]; then
  shm_free=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1 || echo 0)
  GLM_MODEL=$([ "${shm_free:-0}" -gt $((60 * 2**30)) ] && echo /dev/shm/glm.gguf || echo models/glm.gguf)
fi
# strata on the glm4.5-air file inside LIMIT: the automatic planner loan off / on at 31k
# (FLAGS: --mtp --spec 2 unless given; "plain" for none)
glm_strata() {
  local limit=$1 flags=${2:---mtp --spec 2} tag=$1
  [ "$flags" = plain ] && flags="" tag=$1-plain
  [ -f "$OUT/glm-info.md" ] || strata info "$GLM_MODEL" | tail -28 > "$OUT/glm-info.md"
  echo "#### strata, --vram-limit $limit ${flags:-(no --mtp)}" | tee -a "$OUT/glm.md"
  # shellcheck disable=SC2086  # flags are words
  STRATA_TRACE=1 strata bench --model "$GLM_MODEL" --device cuda --vram-limit "$limit" \
    $flags --kv q4_0 --h2d-gbs 55.3 --peak-tflops 989 --scenario auto --runs 1 \
    --prompt-tokens 31258 --max-new 16 --ctx 31400 --json "$OUT/glm-$tag.json" \
    > "$OUT/glm-$tag.log" 2>&1 || true
  grep -E "^(\||#)|strata loan: restored|plan |mtp.experts holds|GPU peak|error|Error" "$OUT/glm-$tag.log" \
    | grep -vE "^  (chunk|strata serve: prompt)" | cut -c1-300 | tee -a "$OUT/glm.md" || true
}
# sampled decode at depth 31k inside $GLM_TG_LIMIT (8GiB) with the loan (the prefill is the loan's)
glm_tg() {
  p31k
  local limit=${GLM_TG_LIMIT:-8GiB}
  echo "#### strata, sampled decode at depth 31k ($limit, loan on, T 1.0, seed 1)" | tee -a "$OUT/glm.md"
  STRATA_TRACE=1 STRATA_PREFILL_ELASTIC_LOAN=1 STRATA_PREFILL_MTP_LOAN=1 STRATA_PREFILL_HEAD_LOAN=1 \
    strata run --serve --vram-elastic --model "$GLM_MODEL" --device cuda --vram-limit "$limit" \
    --mtp --spec 2 --kv q4_0 --ctx 31600 --tokens-file /tmp/p31k.txt --max-new 128 --temperature 1.0 --seed 1 \
    2>&1 >/dev/null | grep -E "strata serve|strata spec|mtp.experts|GPU peak|error" | cut -c1-300 \
    | tee -a "$OUT/glm.md"
}
# llama.cpp on the same file: experts in host memory, mapped (-lm mmap) and not repacked (the
# repacked copy would not fit beside the 59 GiB file in 128 GiB), flash attention, q4_0 KV;
# waits for a build still running beside it (`lbuild & mglm` then `glm`)
glm_llama_bench() {
  local lb=.llama-build/bin/llama-bench
  while [ -f /tmp/lbuild.running ]; do sleep 2; done  # the lbuild stage's marker
  if [ ! -x "$lb" ]; then
    echo "llama.cpp: no llama-bench (run the lbuild stage first)" | tee -a "$OUT/glm.md"; return
  fi
  echo "#### llama.cpp ($(grep -o 'llama.cpp-[0-9.]*[0-9]' "$OUT/lbuild.log" 2>/dev/null | head -1))" \
    | tee -a "$OUT/glm.md"
  local ub=${GLM_UB:-8192}
  local common="-m $GLM_MODEL -ngl 99 -ot exps=CPU -fa 1 -ctk q4_0 -ctv q4_0 -lm mmap --repack 0 -r 1 -o md -ub $ub -b $ub"
  llama_pp_tg llama-glm glm.md "$lb" "$common" "$common -n 32"
}
# llama.cpp's MTP drafts from the file's nextn block, sampled and greedy, 128 tokens
glm_llama_mtp() {
  local ls=.llama-build/bin/llama-speculative-simple
  [ -x "$ls" ] || return 0
  for temp in ${GLM_LLAMA_TEMPS:-1.0 0}; do
    timeout 120 "$ls" -m "$GLM_MODEL" -ngl 99 -ot exps=CPU -fa on -ctk q4_0 -ctv q4_0 -c 4096 \
      --spec-type draft-mtp --spec-draft-n-max 2 --temp "$temp" --seed 1 -n 128 \
      -p "Tell me about the rivers of Europe and the cities on their banks." \
      > "$OUT/llama-mtp-$temp.log" 2>&1 || true
    grep -E "decoded|n_drafted|n_accept|accept |error" "$OUT/llama-mtp-$temp.log" \
      | sed "s/^/llama.cpp draft-mtp T $temp: /" | tee -a "$OUT/glm.md" || true
  done
}
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    tests) python3 -m pytest -p no:cacheprovider -rfE --tb=short --durations=15 ${TESTS:-tests/test_gpu_*.py \
             tests/test_telemetry.py} > "$OUT/gpu-tests.txt" 2>&1 || true  # written as it runs: a
           tail -80 "$OUT/gpu-tests.txt" ;;  # call cut short by its limit still returns what ran
    kbench) python3 -m engine.tools.kernel_bench --out "$OUT" ;;
    vtests) python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_vram_limit.py \
              tests/test_gpu_backend.py tests/test_gpu_engine.py tests/test_telemetry.py 2>&1 \
              | tail -60 | tee "$OUT/vram-tests.txt" || true ;;
    vram) p31k
          STRATA_PREFILL_ELASTIC_LOAN=1 STRATA_PREFILL_MTP_LOAN=1 STRATA_PREFILL_HEAD_LOAN=1 \
          STRATA_TRACE=1 strata run --serve --vram-elastic --model models/q48.gguf --device cuda \
            --vram-limit 8GiB --mtp --spec 2 --kv q4_0 --ctx 31900 --tokens-file /tmp/p31k.txt \
            --max-new 128 2>&1 | grep -E "vram|memory|GPU peak|strata serve|strata loan|warning" \
            | cut -c1-300 \
            | tee "$OUT/vram.md"
          strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB --mtp --spec 2 \
            --kv q4_0 --scenario auto --runs 1 --prompt-tokens 31258 --max-new 128 \
            --ctx 31900 2>&1 | tee -a "$OUT/vram.md" ;;
    cmp31) p31k
          root=$PWD out_abs=$(cd "$OUT" && pwd)
          for r in $(seq "${ROUNDS:-2}"); do
            for side in base new; do
              dir=$([ "$side" = base ] && echo "${BASE:?BASE=dir of the engine before}" || echo .)
              limit=$([ "$side" = base ] && echo "${BASE_LIMIT:-8GiB}" || echo "${NEW_LIMIT:-8GiB}")
              (cd "$dir" && PYTHONPATH=/tmp/site:$PWD STRATA_CACHE_DIR=/tmp/sc-$side STRATA_TRACE=1 \
                python3 -m engine.cli bench --model "$root/models/q48.gguf" --device cuda \
                --vram-limit "$limit" --mtp --spec 2 --kv q4_0 --scenario ab --prefill 4096 --runs 1 \
                --prompt-tokens 31258 --max-new 64 --ctx 31400 \
                --json "$out_abs/cmp-$side-$r.json") > "$OUT/cmp-$side-$r.log" 2>&1 || true
              grep -E "strata loan: restored|^\||error" "$OUT/cmp-$side-$r.log" \
                | sed "s/^/$side $r: /" | tee -a "$OUT/cmp31.md" || true
            done
          done
          for side in base new; do
            echo "== $side, pooled"; strata bench --merge "$OUT"/cmp-$side-*.json
          done 2>&1 | tee -a "$OUT/cmp31.md" ;;
    cmpdemo) root=$PWD out_abs=$(cd "$OUT" && pwd)  # the demo before (BASE) and after a change
          for side in base new; do
            dir=$([ "$side" = base ] && echo "${BASE:?BASE=dir of the engine before}" || echo .)
            (cd "$dir" && PYTHONPATH=/tmp/site:$PWD STRATA_CACHE_DIR=/tmp/sd-$side \
              python3 -m engine.cli bench --model "$root/engine/assets/demo.gguf" --device cuda \
              --mtp --spec 2 --scenario ab --prefill 256 --scenario auto --runs 1 \
              --prompt-tokens 2048 --max-new 64 --ctx 4096 \
              --json "$out_abs/cmpdemo-$side.json") > "$OUT/cmpdemo-$side.log" 2>&1 || true
            grep -E "^\||error" "$OUT/cmpdemo-$side.log" | sed "s/^/$side: /" \
              | tee -a "$OUT/cmpdemo.md" || true
          done
          python3 scripts/reply_crcs.py "$OUT"/cmpdemo-*.json 2>&1 | tee -a "$OUT/cmpdemo.md" || true ;;
    lever) n=${LEVER_TOKENS:-31258}
          for r in $(seq "${ROUNDS:-1}"); do
            for side in A B; do
              flags=$([ "$side" = A ] && echo "${LEVER_A:---dense float}" || echo "${LEVER_B:---dense quant}")
              echo "-- round $r side $side: $flags" | tee -a "$OUT/lever.md"
              STRATA_TRACE=1 strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB \
                --mtp --spec 2 --kv q4_0 --scenario auto --runs 1 --prompt-tokens "$n" \
                --max-new "${MAX_NEW_LEVER:-128}" --ctx $((n + 256)) $flags \
                --json "$OUT/lever-$side-$r.json" > "$OUT/lever-$side-$r.log" 2>&1 || true
              grep -E "^\||token graph|error|Error" "$OUT/lever-$side-$r.log" | cut -c1-400 \
                | tee -a "$OUT/lever.md" || true
            done
          done
          python3 scripts/reply_crcs.py "$OUT"/lever-*.json 2>&1 | tee -a "$OUT/lever.md" || true
          for side in A B; do
            echo "== $side, pooled"; strata bench --merge "$OUT"/lever-$side-*.json
          done 2>&1 | tee -a "$OUT/lever.md" ;;
    d31) STRATA_TRACE=1 strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB \
          --mtp --spec 2 --kv q4_0 --h2d-gbs 55.3 --peak-tflops 989 --scenario auto \
          --scenario plain --runs "${RUNS_D31:-3}" --prompt-tokens 31258 \
          --max-new "${MAX_NEW_D31:-256}" --json "$OUT/d31.json" 2>&1 \
          | grep -vE "^  (chunk|strata serve: prompt)" | cut -c1-400 | tee "$OUT/d31.md" ;;
    cpol) for r in $(seq "${ROUNDS:-2}"); do
            for pol in static adaptive; do
              STRATA_TRACE=1 strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB \
                --kv q4_0 --scenario plain --runs 1 --prompt-tokens 31258 \
                --max-new "${MAX_NEW_D31:-256}" --cache-policy "$pol" \
                --json "$OUT/cpol-$pol-$r.json" > "$OUT/cpol-$pol-$r.log" 2>&1 || true
              grep -E "^\||expert cache:|token graph|error" "$OUT/cpol-$pol-$r.log" | cut -c1-300 \
                | sed "s/^/$pol $r: /" | tee -a "$OUT/cpol.md" || true
            done
          done
          python3 scripts/reply_crcs.py "$OUT"/cpol-*.json 2>&1 | tee -a "$OUT/cpol.md" || true
          for pol in static adaptive; do
            echo "== $pol, pooled"; strata bench --merge "$OUT"/cpol-$pol-*.json
          done 2>&1 | tee -a "$OUT/cpol.md" ;;
    dec31) warm=""
          for pol in static adaptive; do
            STRATA_TRACE=1 strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB \
              --kv q4_0 --mtp --spec 2 --scenario decode --runs 1 --prompt-tokens 31258 \
              --max-new "${MAX_NEW_D31:-256}" --cache-policy "$pol" $warm \
              --json "$OUT/dec31-$pol.json" > "$OUT/dec31-$pol.log" 2>&1 || true
            echo "#### --cache-policy $pol" >> "$OUT/dec31.md"
            grep -E "^(#|\|)|token graph|expert cache:|error|Error" "$OUT/dec31-$pol.log" \
              | cut -c1-400 | tee -a "$OUT/dec31.md" || true
            warm=--no-warmup  # the first process compiled the kernels (CuPy's disk cache)
          done ;;
    ident) strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB --mtp --spec 2 \
          --kv q4_0 --scenario ab --prefill 4096 --scenario auto --runs 1 --prompt-tokens 31258 \
          --max-new 64 --json "$OUT/ident.json" 2>&1 | grep -E "^\|" | tee "$OUT/ident.md"
        python3 scripts/reply_crcs.py "$OUT/ident.json" 2>&1 | tee -a "$OUT/ident.md" || true ;;
    katt) python3 -m engine.tools.kernel_bench --only attention 2>&1 | tee "$OUT/katt.md" ;;
    kmoe) python3 -m engine.tools.kernel_bench --only moe 2>&1 | tee "$OUT/kmoe.md" ;;
    m8) [ -f models/q8.gguf ] || strata make-model models/q8.gguf --preset qwen3-30b-a3b --layers 8 ;;
    adec) for spec in "--model demo --max-new 256 --runs ${RUNS_ADEC:-3}" \
                "--model random-demo --max-new 256 --runs 5" \
                "--model random-demo --max-new 1024 --runs 5"; do
            echo "\`python -m app.bench_decode $spec --device cuda\`" >> "$OUT/adec.md"
            python3 -m app.bench_decode $spec --device cuda 2>>"$OUT/adec.log" | tee -a "$OUT/adec.md"
            echo >> "$OUT/adec.md"
          done ;;
    train) mkdir -p "$OUT/train" models
           python3 -m training build --wordnet .whl/wordnet-base.deb --out models/demo.gguf \
             --minutes "${TRAIN_MINUTES:-5.5}" --seed 0 --log-dir "$OUT/train" ${TRAIN_FLAGS:-} 2>&1 | tail -40 \
             | tee "$OUT/train/build.log"
           (cd models && sha256sum demo.gguf > "$OUT/demo.sha256" && split -b 15M demo.gguf \
             "$OUT/demo.gguf.part.") ;;
    adec48) python3 -m app.bench_decode --model models/q48.gguf --vram-limit 8GiB --max-new 256 \
              --runs "${RUNS_ADEC:-3}" --device cuda 2>"$OUT/adec48.log" | tee "$OUT/adec48.md" ;;
    m48) [ -f models/q48.gguf ] || strata make-model models/q48.gguf --preset qwen3-30b-a3b ;;
    mix) [ -f models/q48km.gguf ] || strata make-model models/q48km.gguf --preset qwen3-30b-a3b \
           --mix q4_k_m 2>"$OUT/make-model.log" || { tail -c 600 "$OUT/make-model.log"; exit 1; }
         strata info models/q48km.gguf | tail -13 | tee "$OUT/mix.md"
         STRATA_TRACE=1 strata bench --model models/q48km.gguf --device cuda --vram-limit 8GiB \
           --mtp --spec 2 --h2d-gbs 55.3 --peak-tflops 989 --scenario auto --runs "${RUNS_MIX:-1}" \
           --prompt-tokens 31258 --max-new 16 --kv q4_0 --ctx 31400 2>&1 \
           | grep -vE "^  (chunk|strata serve: prompt)" | cut -c1-300 | tee -a "$OUT/mix.md"
         p31k
         strata run --model models/q48km.gguf --device cuda --vram-limit 8GiB --kv q4_0 \
           --ctx 31600 --tokens-file /tmp/p31k.txt --max-new 256 --temperature 1.0 --seed 1 \
           2>&1 >/dev/null | grep -E "strata serve|GPU peak|error" | cut -c1-300 \
           | sed 's/^/sampled TG: /' | tee -a "$OUT/mix.md"
         llama_mix ;;
    lmix) llama_mix ;;
    lbuild) touch /tmp/lbuild.running; trap 'rm -f /tmp/lbuild.running' EXIT
            src=$(ls -v .llama-src/llama.cpp-${LLAMA_VER:-*}.tar.gz | tail -1)
            echo "llama.cpp source: $src" | tee "$OUT/lbuild.log"
            rm -rf .llama-build/src && mkdir -p .llama-build/src
            tar -xzf "$src" -C .llama-build/src
            cmake -S .llama-build/src -B .llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
              -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
              -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
              -DLLAMA_BUILD_SERVER=OFF >>"$OUT/lbuild.log" 2>&1 || { tail -30 "$OUT/lbuild.log"; exit 1; }
            cmake --build .llama-build --target llama-bench llama-speculative-simple -j "$(nproc)" \
              >>"$OUT/lbuild.log" 2>&1 || { tail -30 "$OUT/lbuild.log"; exit 1; }
            ls -l .llama-build/bin/llama-bench .llama-build/bin/llama-speculative-simple | tee -a "$OUT/lbuild.log" ;;
    mglm) [ -f "$GLM_MODEL" ] || strata make-model "$GLM_MODEL" --preset glm4.5-air \
            2>"$OUT/make-glm.log" || { tail -c 600 "$OUT/make-glm.log"; exit 1; }
          ls -l "$GLM_MODEL"; df -h "$(dirname "$GLM_MODEL")" | tail -1 ;;
    glm) for limit in ${GLM_LIMITS:-8GiB}; do glm_strata "$limit"; done
         [ -n "${GLM_LLAMA_BENCH-1}" ] && glm_llama_bench
         for limit in ${GLM_LATER_LIMITS-16GiB}; do glm_strata "$limit"; done
         glm_tg
         glm_llama_mtp
         for limit in ${GLM_PLAIN_LIMITS:-}; do glm_strata "$limit" plain; done ;;
    b8) strata bench --model models/q8.gguf --device cuda --vram-limit 5GiB --vram-segment-mib 64 \
          --mtp --spec 2 --scenario auto --scenario ab --prefill 1024 --runs "$RUNS" \
          --prompt-tokens 8192 --max-new 16 --kv q4_0 --ctx 9000 --json "$OUT/b8.json" \
          2>&1 | tee "$OUT/b8.md" ;;
    b31|b72)  # at 72k a fixed 4,096-token chunk does not fit 8 GiB without the loan: auto only
      n=$([ "$stage" = b31 ] && echo 31258 || echo 72061)
      ab=$([ "$stage" = b31 ] && echo "--scenario ab --prefill 4096" || echo "")
      auto="--scenario auto"
      case ${ONLY:-} in auto) ab="" ;; ab) auto="" ;; esac  # ONLY=auto|ab: one table per call
      STRATA_TRACE=1 strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB \
        --mtp --spec 2 --h2d-gbs 55.3 --peak-tflops 989 \
        $auto $ab --runs "$RUNS" --prompt-tokens "$n" \
        --max-new "$MAX_NEW" --kv q4_0 --ctx $((n + MAX_NEW + 64)) --json "$OUT/$stage${ONLY:+-$ONLY}.json" \
        2>&1 | tee "$OUT/$stage${ONLY:+-$ONLY}.md" ;;
    fc) strata bench --forecast --fresh-rates --model models/q48.gguf --device cuda \
          --vram-limit 8GiB --mtp --spec 2 --kv q4_0 --prompt-tokens "${SIZES:-8192,31258,72061}" \
          --runs "$RUNS" --max-new 8 --json "$OUT/forecast.json" 2>&1 | tee "$OUT/forecast.md" ;;
    tg) for spec in "--mtp --spec 2" ""; do
          STRATA_TRACE=1 strata bench --model models/q48.gguf --device cuda --vram-limit 8GiB \
            $spec --scenario auto --runs "$RUNS" --prompt-tokens 2048 --max-new 128 --kv q4_0 \
            --ctx 4096 2>&1 | tee -a "$OUT/tg.md"
        done ;;
    dtrace) for n in 2048 31258; do
          python3 -c "import random,sys; r=random.Random(int(sys.argv[1])); \
print(' '.join(str(r.randrange(1000, 150000)) for _ in range(int(sys.argv[1]))))" $n > /tmp/p$n.txt
          for spec in "--mtp --spec 2" ""; do
            echo "-- $n tokens ${spec:-no speculation}"
            STRATA_TRACE=1 strata run --model models/q8.gguf --device cuda --vram-limit 8GiB $spec \
              --kv q4_0 --ctx 33000 --tokens-file /tmp/p$n.txt --max-new 96 2>&1 \
              | grep -E "token graph|strata serve: prompt [0-9]" | cut -c1-400
          done
        done ;;
    mphase) python3 -c "import random; r=random.Random(7); \
print(' '.join(str(r.randrange(1000, 150000)) for _ in range(16384)))" > /tmp/p16k.txt
          STRATA_TRACE=1 strata run --model models/q8.gguf --device cuda --vram-limit 8GiB \
            --kv q4_0 --ctx 17000 --tokens-file /tmp/p16k.txt --max-new 4 2>&1 \
            | grep -E "prefill phases|strata serve: prompt" | tee "$OUT/mphase.txt" ;;
    gprof) python3 -m engine.tools.graph_profile --model "${GPROF_MODEL:-models/q48.gguf}" --pos 2048,31000 \
             2>&1 | tee "$OUT/gprof.md" ;;
    prof) python3 -m cProfile -o "$OUT/prof.out" -m engine.cli run --model models/q48.gguf \
            --device cuda --vram-limit 8GiB --mtp --spec 2 --kv q4_0 --ctx 4096 \
            --prompt "Tell me about rivers." --max-new 48 > "$OUT/prof-run.txt" 2>&1 || true
          python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(45)" \
            "$OUT/prof.out" > "$OUT/prof.txt" ;;
    pprof) p31k
          STRATA_PREFILL_ELASTIC_LOAN=1 STRATA_PREFILL_MTP_LOAN=1 STRATA_PREFILL_HEAD_LOAN=1 \
          STRATA_TRACE=1 python3 -m cProfile -o "$OUT/pprof.out" -m engine.cli run --serve --vram-elastic \
            --model models/q48.gguf --device cuda --vram-limit 8GiB --mtp --spec 2 --kv q4_0 --ctx 31900 \
            --tokens-file /tmp/p31k.txt --max-new 8 > "$OUT/pprof-run.txt" 2>&1 || true
          python3 -c "import pstats,sys; s=pstats.Stats(sys.argv[1]); \
s.sort_stats('tottime').print_stats(30); s.sort_stats('cumtime').print_stats(40)" \
            "$OUT/pprof.out" > "$OUT/pprof.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
