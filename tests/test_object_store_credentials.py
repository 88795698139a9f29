"""Credentials and object storage (README, "Object storage"; docs/object-storage.md, "Credentials"), on moto's S3
server started here on 127.0.0.1.

A password in the store's URL (`storage.endpoint_url: http://user:password@host`, AWS_ENDPOINT_URL) or a secret in a
URL's query string appears in no output object (_SUCCESS, _report.html, _timeline.json, the parts) and no line that
`run`, `plan`, `status` or `report` prints, a failure's error line included.

Credentials come from the AWS SDKs' chain: on a second server that checks every request's signature against the
IAM users and roles it knows (moto's INITIAL_NO_AUTH_ACTION_COUNT: the setup's requests unchecked, every later one
checked), a profile with `role_arn` and `source_profile` (moto's STS assumes the role) and one with
`credential_process` read an s3:// input and write an s3:// output, and a proxy in front of the server records which
access key signed each request."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from s3_server import S3Server, ThrottlingProxy, free_port, start_s3_server, start_s3_server_holding

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
PROMPTS = ROOT / "data" / "samples" / "prompts.parquet"
PASSWORD = "EndpointPassw0rd-5e1f"  # planted in URLs: never in any output
SIGNATURE = "QuerySignature-77ab90"
PROXY_PASSWORD = "ProxyPassw0rd-c3d2"
ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
TRUST_ANYONE = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]})


@pytest.fixture(scope="module")
def s3():
    server = start_s3_server_holding({"inputs/sample/prompts.parquet": PROMPTS}, ("outputs",))
    yield server
    server.stop()


def write_job(tmp_path: Path, name: str, out_path: str, storage: dict | None = None) -> Path:
    job = json.loads(json.dumps(SAMPLE))
    job["dtype"] = "float32"
    job["sampling"]["max_tokens"] = 4
    job["input"]["path"] = "s3://inputs/sample/prompts.parquet"
    job["output"] = {**job["output"], "path": out_path}
    job["storage"] = {"lease_ttl_s": 6, **(storage or {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def batchgen(command: str, target: Path | str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", command, str(target), *args], capture_output=True,
                          text=True, timeout=900, env=env)


def objects(client, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def texts_of(done: list[subprocess.CompletedProcess], found: dict[str, bytes] = {}) -> list[str]:
    return [*(done_.stdout for done_ in done), *(done_.stderr for done_ in done),
            *(data.decode("latin-1") for data in found.values())]


def with_password(endpoint: str) -> str:
    return endpoint.replace("http://", f"http://batchgen-user:{PASSWORD}@")


def test_a_password_in_the_endpoint_is_in_no_output_object_and_no_line(tmp_path, s3):
    """The store is reached through the URL with its userinfo (obstore signs the requests as usual); the job, its
    plan, status and report show the endpoint as http://***@host:port."""
    endpoint = with_password(s3.endpoint)
    job = write_job(tmp_path, "userinfo", "s3://outputs/userinfo", storage={"endpoint_url": endpoint})
    env = s3.env()
    planned = batchgen("plan", job, env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    done = batchgen("run", job, env, "--log-format", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    env_with_password = s3.env(AWS_ENDPOINT_URL=endpoint)  # status and report take the endpoint from the environment
    status = batchgen("status", "s3://outputs/userinfo", env_with_password, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "finished", status.stderr[-3000:]
    report = batchgen("report", "s3://outputs/userinfo", env_with_password, "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr[-3000:]
    found = objects(s3.client(), "outputs", "userinfo")
    assert {"_SUCCESS", "_report.html", "_timeline.json"} <= set(found)
    summary = json.loads(found["_SUCCESS"])
    assert summary["job"]["storage"]["endpoint_url"] == s3.endpoint.replace("http://", "http://***@")
    texts = texts_of([planned, done, status, report], found) + [(tmp_path / "report.html").read_text()]
    assert not [text[:200] for text in texts if PASSWORD in text or "batchgen-user" in text]


def test_a_failures_error_line_hides_the_endpoints_password_and_query_secrets(tmp_path, s3):
    """A store that cannot be reached: obstore's message names the URL it tried, userinfo and query string included;
    the error line (plain and --log-format json, for run and plan) shows neither the password nor the signature."""
    dead = f"http://127.0.0.1:{free_port()}"
    env = s3.env(HTTP_PROXY=f"http://proxy-user:{PROXY_PASSWORD}@127.0.0.1:{free_port()}", NO_PROXY="*")
    for name, endpoint in (("userinfo", with_password(dead)), ("query", f"{dead}/?X-Amz-Signature={SIGNATURE}")):
        job = write_job(tmp_path, name, f"s3://outputs/{name}", storage={"endpoint_url": endpoint, "max_retries": 0,
                                                                             "timeout_s": 5})
        runs = [batchgen("run", job, env), batchgen("run", job, env, "--log-format", "json"),
                batchgen("plan", job, env)]
        for done in runs:
            assert done.returncode == 1, done.stderr[-3000:]
            assert "the object store failed after its retries" in done.stderr.strip().splitlines()[-1]
            assert "127.0.0.1" in done.stderr  # the line still names the store, without its secrets
        texts = texts_of(runs)
        assert not [text[-500:] for text in texts if PASSWORD in text or SIGNATURE in text or PROXY_PASSWORD in text]
    assert "X-Amz-Signature=***" in runs[0].stderr


@pytest.fixture(scope="module")
def iam_s3():
    """A server that checks signatures once set up: an IAM user allowed everything (two access keys), a role it may
    assume, the buckets and the input. The setup's requests pass unchecked (INITIAL_NO_AUTH_ACTION_COUNT); the
    count is generous, and requests signed with unknown keys use up the rest until the server refuses one."""
    server = start_s3_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "20"})
    iam = client_of(server, "iam", "AKIASETUPUNCHECKED00", "unchecked")
    iam.create_user(UserName="pipeline")
    iam.put_user_policy(UserName="pipeline", PolicyName="all", PolicyDocument=ALLOW_ALL)
    keys = [iam.create_access_key(UserName="pipeline")["AccessKey"] for _ in range(2)]
    role = iam.create_role(RoleName="batchgen-job", AssumeRolePolicyDocument=TRUST_ANYONE)["Role"]
    iam.put_role_policy(RoleName="batchgen-job", PolicyName="all", PolicyDocument=ALLOW_ALL)
    setup = client_of(server, "s3", "AKIASETUPUNCHECKED00", "unchecked")
    for bucket in ("inputs", "outputs"):
        setup.create_bucket(Bucket=bucket)
    setup.put_object(Bucket="inputs", Key="sample/prompts.parquet", Body=PROMPTS.read_bytes())
    for _ in range(20):
        try:
            setup.head_bucket(Bucket="inputs")
        except Exception:
            break  # checked from now on
    else:
        pytest.fail("moto's server never began checking signatures")
    yield server, keys, role["Arn"]
    server.stop()


def client_of(server: S3Server, service: str, key_id: str, secret: str):
    import boto3

    return boto3.client(service, endpoint_url=server.endpoint, aws_access_key_id=key_id,
                        aws_secret_access_key=secret, region_name="us-east-1")


def profile_env(tmp_path: Path, profile: str, config: str, credentials: str = "", **extra: str) -> dict[str, str]:
    """Only the profile gives credentials: no AWS_* variable but the files', and no metadata service asked."""
    (tmp_path / "config").write_text(config)
    (tmp_path / "credentials").write_text(credentials)
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    return {**env, "AWS_PROFILE": profile, "AWS_CONFIG_FILE": str(tmp_path / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_EC2_METADATA_DISABLED": "true",
            **extra}


def run_through_proxy(tmp_path: Path, server: S3Server, env: dict, name: str) -> tuple[subprocess.CompletedProcess,
                                                                                       set[str]]:
    """The job from s3:// to s3://, its S3 requests through a proxy recording the access keys that signed them."""
    proxy = ThrottlingProxy(server.endpoint, throttled=0)
    try:
        done = batchgen("run", write_job(tmp_path, name, f"s3://outputs/{name}"),
                        {**env, "AWS_ENDPOINT_URL_S3": proxy.endpoint})
    finally:
        proxy.stop()
    return done, proxy.access_keys


def test_a_role_arn_profile_assumes_the_role_through_sts_and_signs_with_its_keys(tmp_path, iam_s3):
    server, keys, role_arn = iam_s3
    env = profile_env(tmp_path, "job",
                      f"[profile base]\nregion = us-east-1\n\n[profile job]\nrole_arn = {role_arn}\n"
                      f"source_profile = base\nregion = us-east-1\n",
                      f"[base]\naws_access_key_id = {keys[0]['AccessKeyId']}\n"
                      f"aws_secret_access_key = {keys[0]['SecretAccessKey']}\n",
                      AWS_ENDPOINT_URL_STS=server.endpoint)
    done, signed_with = run_through_proxy(tmp_path, server, env, "role")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(signed_with) == 1 and next(iter(signed_with)).startswith("ASIA"), signed_with  # the role's session
    reader = client_of(server, "s3", keys[0]["AccessKeyId"], keys[0]["SecretAccessKey"])
    found = objects(reader, "outputs", "role")
    assert json.loads(found["_SUCCESS"])["rows"] == 30
    secrets = [keys[0]["SecretAccessKey"], keys[0]["AccessKeyId"], *signed_with]
    assert not [text[:200] for text in texts_of([done], found) if any(secret in text for secret in secrets)]


def test_a_credential_process_profile_gives_the_keys_and_redact_removes_them(tmp_path, iam_s3):
    server, keys, _ = iam_s3
    marker = tmp_path / "process-ran"
    script = tmp_path / "credentials.py"
    script.write_text(f"import json, pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                      f"print(json.dumps({{'Version': 1, 'AccessKeyId': {keys[1]['AccessKeyId']!r}, "
                      f"'SecretAccessKey': {keys[1]['SecretAccessKey']!r}}}))\n")
    env = profile_env(tmp_path, "process", f"[profile process]\nregion = us-east-1\n"
                                           f"credential_process = \"{sys.executable}\" \"{script}\"\n")
    done, signed_with = run_through_proxy(tmp_path, server, env, "process")
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.read_text() == "ran" and signed_with == {keys[1]["AccessKeyId"]}
    reader = client_of(server, "s3", keys[0]["AccessKeyId"], keys[0]["SecretAccessKey"])
    found = objects(reader, "outputs", "process")
    assert json.loads(found["_SUCCESS"])["rows"] == 30
    secrets = [keys[1]["SecretAccessKey"], keys[1]["AccessKeyId"]]
    assert not [text[:200] for text in texts_of([done], found) if any(secret in text for secret in secrets)]
    # the keys the chain resolved, which are in no environment variable or shared file, are known to redact
    shown = subprocess.run([sys.executable, "-c", "from batchgen.aws_credentials import current_credentials\n"
                            "from batchgen.redaction import redact\nkeys = current_credentials()\n"
                            "print(redact(keys['access_key_id'] + ' ' + keys['secret_access_key']))"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0 and shown.stdout.strip() == "*** ***", shown.stderr[-2000:]
