#!/bin/bash
# Runs docs/reproductions.md's studies one after another (issue 34), each into its own store
# STORES/<spec>/mlflow.db; run it again after a stop and a study that did not finish goes on
# with `pfl-run SPEC --resume` (its finished tuning trials and final runs kept), the finished
# ones are skipped. Each study's folder records its commands, start, end, exit status and log.
#
#   bash scripts/reproductions_queue.sh [STORES]        # default STORES: ../repro
set -u
cd "$(dirname "$0")/.."
STORES=$(realpath -m "${1:-../repro}")
PFL_RUN=${PFL_RUN:-.venv/bin/pfl-run}
for name in repro_fedmosaic_flipped repro_fedmosaic_fmnist_pathological repro_fedsimsup_cifar10_shards \
            repro_fedsimsup_cifar10_dirichlet repro_fedmosaic_pacs_feature_shift repro_fedmosaic_pacs_hybrid \
            repro_pmixfed_cifar10 repro_pmixfed_mnist repro_fedmosaic_fmnist_baselines repro_fedsimsup_cifar10_baselines \
            repro_pmixfed_cifar10_baselines repro_cosmos_cifar10; do
  d=$STORES/$name
  [ -f $d/done ] && continue
  mkdir -p $d
  resume=""; out=$d/out
  if [ -f $d/mlflow.db ]; then resume="--resume"; n=$(ls -d $d/out* | wc -l); out=$d/out$((n+1)); fi
  cmd="$PFL_RUN specs/$name.toml --tracking-uri sqlite:///$d/mlflow.db --quiet --yes $resume --out $out"
  echo "$cmd" >> $d/commands
  echo "start $(date -u +%FT%TZ)" >> $d/commands
  start=$(date +%s)
  $cmd > $d/log.$(date +%s) 2>&1
  rc=$?
  echo "end $(date -u +%FT%TZ) rc=$rc wall_s=$(( $(date +%s) - start ))" >> $d/commands
  [ $rc -eq 0 ] && touch $d/done
done
