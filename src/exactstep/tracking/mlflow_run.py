"""MLflow (X3): the run's figures in a local MLflow file store or at a tracking URI.

``log.mlflow = DIR`` logs into a file store at ``DIR``; a URI (``sqlite:///...``,
``http://...``) logs there instead. Each start of an exactstep run is one MLflow run (a
segment), and an ``http(s)`` server is asked once, with a bounded wait, before MLflow
is used, so a server that is down is refused at once (X4).
Design and derivations: docs/design/tracking.md#trackingmlflow_runpy (X3, X4, S5).
"""

from __future__ import annotations

import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from pathlib import Path
from typing import Any

from exactstep.errors import ConfigError
from exactstep.tracking.base import FigureTracker, RunIdentity

PARAMS_PER_BATCH = 100  # MLflow's limit on parameters per log_batch call
PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
SERVER_TIMEOUT_S = 5.0  # the bound on the first answer of an http(s) tracking server
GATEWAY_ERRORS = (502, 503, 504)  # a proxy answering for a server that is down


def tracking_uri(where: str) -> str:
    """``where`` as an MLflow tracking URI: a URI as it is, a directory as ``file:``."""
    if "://" in where or where.startswith("file:"):
        return where
    path = Path(where).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"log.mlflow: cannot create {path} ({exc.strerror or exc}); choose a "
                          "writable directory or set log.mlflow = \"\"") from exc
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return path.as_uri()


def check_server(uri: str, timeout: float = SERVER_TIMEOUT_S) -> None:
    """Refuse an ``http(s)`` tracking ``uri`` whose server does not answer one GET of
    ``uri/health`` within ``timeout`` seconds (connection refused, no such host, no
    answer, or a gateway's 502/503/504 for it). Any other HTTP answer, an error status
    or a TLS handshake MLflow may be set up to accept included, counts as a server
    that is up; other URIs are not asked."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    netloc = parts.netloc.rpartition("@")[2]  # credentials are MLflow's to send
    uri = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        if exc.code not in GATEWAY_ERRORS:
            return  # it answered
        reason: object = f"HTTP {exc.code}: a proxy or gateway answered for it"
    except (OSError, HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, ssl.SSLError):
            return  # it answered; its certificate is MLflow's settings' business
    raise ConfigError(
        f"log.mlflow = {uri!r}: the tracking server did not answer GET {url} within "
        f"{timeout:g} s ({reason}); start the server, correct the URI, or set "
        "log.mlflow = \"\"")


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted ``section.key`` parameters of a nested configuration."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:PARAM_CHARS]
    return out


class MlflowTracker(FigureTracker):
    """One MLflow run per start of the exactstep run (a segment).

    Named ``NAME@START`` in ``experiment``, tagged ``exactstep.run`` (``NAME-DIGEST12``),
    ``exactstep.start_window`` and ``exactstep.manifest_digest``, with the resolved
    configuration as dotted parameters; earlier segments get
    ``exactstep.superseded_after``. Raises ``ConfigError`` when ``mlflow`` is missing,
    an ``http(s)`` server does not answer within ``SERVER_TIMEOUT_S`` (``check_server``),
    or MLflow cannot open or write the store.
    """

    def __init__(self, where: str, identity: RunIdentity, *, experiment: str) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError(
                "log.mlflow needs the mlflow-skinny package; install the 'track' extra "
                "(pip install 'exactstep[track]') or set log.mlflow = \"\"") from exc
        uri = tracking_uri(where)
        check_server(uri)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (found.experiment_id if found is not None
                             else self.client.create_experiment(experiment))
            self.supersede(experiment_id, identity)
            run = self.client.create_run(
                experiment_id, run_name=f"{identity.name}@{identity.start}",
                tags={"exactstep.run": identity.key,
                      "exactstep.start_window": str(identity.start),
                      "exactstep.manifest_digest": identity.digest})
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in flat_params(identity.config).items()]
            for i in range(0, len(params), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])
        except ConfigError:
            raise
        except Exception as exc:  # MLflow's own errors: a store it cannot open or write
            raise ConfigError(f"log.mlflow = {where!r}: MLflow could not start a run ({exc}); "
                              "choose a writable directory or set log.mlflow = \"\"") from exc

    def supersede(self, experiment_id: str, identity: RunIdentity) -> None:
        """Mark the run's earlier segments: their figures after this start are stale."""
        earlier = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`exactstep.run` = '{identity.key}'")
        for seg in earlier:
            seen = seg.data.tags.get("exactstep.superseded_after")
            if seen is None or int(seen) > identity.start:
                self.client.set_tag(seg.info.run_id, "exactstep.superseded_after",
                                    str(identity.start))
            if seg.info.status == "RUNNING":
                self.client.set_terminated(seg.info.run_id, status="KILLED")

    def write(self, figures: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step)
                                                    for k, v in figures.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")
