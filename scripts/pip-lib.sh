# Sourced by the install-*.sh scripts: one way to run pip and to fail.
#
#   pip_install PYTHON ARGS...   pip install ARGS into PYTHON's environment, quietly, logged to
#                                $log; a failed try (a dropped connection, a timed-out download of
#                                a 500 MB wheel) is retried twice, 10 s apart, before it counts;
#                                a release the index does not have is not retried.
#   fail MESSAGE                 one line naming the script, then the last lines pip wrote (what
#                                went wrong, so a CI log says it without the log file), exit 2.
# Needs $log and $NAME set by the caller.
pip_install() {
  local py=$1; shift
  local try
  for try in 1 2 3; do
    echo "pip install $* (try $try of 3)" >>"$log"
    "$py" -m pip install -q --retries 5 --timeout 120 "$@" >>"$log" 2>&1 && return 0
    tail -n 3 "$log" | grep -q "No matching distribution" && return 1      # not there: no retry
    [ "$try" = 3 ] || sleep 10
  done
  return 1
}
fail() {
  echo "$NAME: $1 (pip log: $log)" >&2
  if [ -s "$log" ]; then
    grep -v "WARNING: Location\|^\s*$" "$log" | tail -n 3 | sed "s/^/$NAME:   /" >&2 || true
  fi
  exit 2
}
