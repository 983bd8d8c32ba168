"""``cluster.yaml`` through Ray's own AWS launcher, against the AWS APIs as moto
mocks them in-process (no network, no account).

What runs is what ``ray up cluster.yaml`` runs: Ray's config preparation, its
resource detection from EC2's instance types, its validation and its AWS
bootstrap (IAM role and instance profile, key pair, subnets, security group),
then ``get_or_create_head_node`` launching the head.  Only the SSH session
that would set the head up is replaced (by a recorder of what it was given).
Then what the head's autoscaler runs: the head's ``pin-image`` step on the
config ``ray up`` uploads, the v2 scheduler (Ray 2.60's default for ``ray
up``) planning nodes for a demand, and its node provider launching them.

moto accepts ``resolve:ssm:...`` ImageIds without resolving them; EC2
resolves them server side with the caller's permissions.  The test resolves
them the way EC2 does, from the (moto) Parameter Store, where it has put the
public parameter AWS publishes for its Deep Learning Base AMI.
"""
import copy
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO

pytestmark = pytest.mark.cluster

pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]'); the AWS rehearsal needs it")
pytest.importorskip("boto3", reason="boto3 is not installed (it comes with moto)")

REGION = "us-west-2"
PARAM = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
DLAMI = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20251031"
GROUP = "ray-autoscaler-rayfed-dg"
WORLD = "0.0.0.0/0"


@pytest.fixture
def aws(tmp_path, monkeypatch):
    """moto's EC2/IAM/SSM, credentials that are not real ones, a home folder
    for the key pair Ray writes, and what EC2 does that moto does not."""
    import boto3
    from moto import mock_aws
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ssm.models import Parameter, ssm_backends
    from ray.autoscaler._private.aws import config as aws_config
    from ray.autoscaler._private.aws import utils as aws_utils

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": REGION, "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
                 "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"), "HOME": str(tmp_path),
                 "RAY_USAGE_STATS_ENABLED": "0",
                 "MOTO_IAM_LOAD_MANAGED_POLICIES": "true"}.items():  # Ray attaches AmazonEC2FullAccess, ...
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # the bootstrap waits 15 s twice for IAM to propagate; moto's IAM is consistent at once
    monkeypatch.setattr(aws_config, "time", SimpleNamespace(sleep=lambda s: None, time=time.time))
    aws_utils.resource_cache.cache_clear()
    aws_utils.client_cache.cache_clear()
    runs = []  # (InstanceType, ImageId as asked) of every RunInstances
    profiles = []  # the IamInstanceProfile each RunInstances asked for

    def as_ec2(params, **_):  # what EC2 does and moto does not
        runs.append((params.get("InstanceType"), params.get("ImageId")))
        profiles.append(params.get("IamInstanceProfile"))
        # EC2 launches MaxCount instances when it has the capacity (moto launches MinCount; Ray asks 1..count)
        params["MinCount"] = params.get("MaxCount", params.get("MinCount"))
        # ImageId=resolve:ssm:NAME is the AMI id the parameter NAME holds
        if str(params.get("ImageId", "")).startswith("resolve:ssm:"):
            name = params["ImageId"][len("resolve:ssm:"):]
            params["ImageId"] = boto3.client("ssm", REGION).get_parameter(Name=name)["Parameter"]["Value"]

    def profile_each(parsed, **_):  # EC2 gives every instance of a launch its profile; moto only the first
        for inst in parsed.get("Instances", [])[1:] if profiles[-1] else []:
            boto3.client("ec2", REGION).associate_iam_instance_profile(IamInstanceProfile=profiles[-1],
                                                                        InstanceId=inst["InstanceId"])

    with mock_aws():
        boto3.setup_default_session()  # (mock_aws resets it) every client Ray makes comes from this session
        boto3.DEFAULT_SESSION.events.register("provide-client-params.ec2.RunInstances", as_ec2)
        boto3.DEFAULT_SESSION.events.register("after-call.ec2.RunInstances", profile_each)
        ec2 = boto3.client("ec2", REGION)
        image = ec2.register_image(Name=DLAMI, Architecture="x86_64", RootDeviceName="/dev/sda1")["ImageId"]
        # a public parameter (/aws/...) cannot be put through the API; AWS publishes it, so does the test
        ssm_backends[DEFAULT_ACCOUNT_ID][REGION]._parameters[PARAM].append(Parameter(
            account_id=DEFAULT_ACCOUNT_ID, name=PARAM, value=image, parameter_type="String", description=None,
            allowed_pattern=None, keyid=None, last_modified_date=None, version=1, data_type="aws:ec2:image"))
        yield SimpleNamespace(ec2=ec2, iam=boto3.client("iam", REGION), image=image, runs=runs, home=tmp_path)
    aws_utils.resource_cache.cache_clear()
    aws_utils.client_cache.cache_clear()
    boto3.DEFAULT_SESSION = None


def _admits(perms, port, source):
    """Does a rule of ``perms`` let TCP ``port`` in from ``source`` (a CIDR or a group id)?"""
    for r in perms:
        all_ports = r["IpProtocol"] == "-1"
        if not (all_ports or (r["IpProtocol"] == "tcp" and r["FromPort"] <= port <= r["ToPort"])):
            continue
        if source in [g["GroupId"] for g in r.get("UserIdGroupPairs", [])] + \
                [c["CidrIp"] for c in r.get("IpRanges", [])]:
            return True
    return False


def _tags(instance):
    return {t["Key"]: t["Value"] for t in instance.get("Tags", [])}


def _instances(ec2):
    return [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
            if i["State"]["Name"] in ("pending", "running")]


def test_ray_up_of_cluster_yaml_against_moto(aws, monkeypatch):
    import ray
    from ray.autoscaler._private import commands
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler.v2.instance_manager.config import FileConfigReader
    from ray.autoscaler.v2.instance_manager.node_provider import NodeProviderAdapter
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, ResourceRequestUtil, SchedulingRequest
    from ray.core.generated.autoscaler_pb2 import ResourceRequestByCount

    from rayfed_dg import cluster as rcluster

    t0 = time.monotonic()
    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())

    # ---- ray up: prepare, detect resources, validate, bootstrap (IAM, key pair, subnets, security group)
    config = commands._bootstrap_config(copy.deepcopy(raw), no_config_cache=True)
    ec2 = aws.ec2
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [GROUP]}])["SecurityGroups"]
    assert len(groups) == 1, "Ray's bootstrap made no security group: a node_config names SecurityGroupIds"
    sg = groups[0]
    for name, node in config["available_node_types"].items():
        assert node["node_config"]["SecurityGroupIds"] == [sg["GroupId"]], name

    # the declared worker resources are what EC2 says a g5.xlarge has (Ray adds its A10G accelerator type)
    worker = config["available_node_types"]["gpu_worker"]
    assert worker["resources"]["CPU"] == 4 and worker["resources"]["GPU"] == 1
    assert worker["resources"].get("accelerator_type:A10G") == 1

    # ---- ray up: launch the head; the SSH session that would set it up only records what it was given
    class Recorder:
        given = []

        def __init__(self, **kw):
            self.kw, self.exitcode = kw, 0
            Recorder.given.append(self)

        def start(self):  # what ray up copies to the head for its autoscaler (the config is a temporary file)
            self.uploads = {remote: Path(local).read_text() for remote, local in self.kw["file_mounts"].items()
                            if remote.startswith("~/ray_bootstrap_")}

        def join(self):
            pass

    monkeypatch.setattr(commands, "NodeUpdaterThread", Recorder)
    provider = AWSNodeProvider(config["provider"], config["cluster_name"])
    commands.get_or_create_head_node(config, str(REPO / "cluster.yaml"), no_restart=False, restart_only=False,
                                     yes=True, override_cluster_name=None, _provider=provider)
    (head,) = _instances(ec2)  # min_workers 0: ray up starts the head only
    assert head["InstanceType"] == "m5.2xlarge"
    assert aws.runs == [("m5.2xlarge", f"resolve:ssm:{PARAM}")]
    assert head["ImageId"] == aws.image
    assert ec2.describe_images(ImageIds=[head["ImageId"]])["Images"][0]["Name"].startswith(
        "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)")
    assert _tags(head) == {"ray-cluster-name": "rayfed-dg", "ray-node-type": "head", "Name":
                           "ray-rayfed-dg-head", "ray-user-node-type": "ray.head.default",
                           "ray-node-status": "uninitialized", "ray-launch-config": _tags(head)["ray-launch-config"]}

    # the user reaches the head by SSH: a public address, the key pair Ray made (private key in ~/.ssh), port 22
    assert head.get("PublicIpAddress")
    key = aws.home / ".ssh" / f"{head['KeyName']}.pem"
    assert key.is_file() and (key.stat().st_mode & 0o077) == 0
    assert config["auth"]["ssh_private_key"] == str(key) and config["auth"]["ssh_user"] == "ubuntu"

    # ---- the security group: the nodes reach each other on every port (GCS 6379, raylet and object
    # manager ports, NFS 2049), the world reaches SSH and nothing else
    assert [g["GroupId"] for g in head["SecurityGroups"]] == [sg["GroupId"]]
    perms = ec2.describe_security_groups(GroupIds=[sg["GroupId"]])["SecurityGroups"][0]["IpPermissions"]
    for port in (6379, 8076, 10001, 2049, 22):
        assert _admits(perms, port, sg["GroupId"]), port
    assert _admits(perms, 22, WORLD)
    for port in (6379, 8265, 10001, 2049, 52365):
        assert not _admits(perms, port, WORLD), port
    assert {t["Key"]: t["Value"] for t in sg.get("Tags", [])}.get("ray-cluster-name") == "rayfed-dg"
    default_vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    assert sg["VpcId"] == head["VpcId"] == default_vpc

    # ---- the head's instance profile: Ray's default, whose role may launch instances and use S3 -- and has no
    # SSM permission, which is why the workers are launched from the head's AMI id, not from the parameter
    profile_name = head["IamInstanceProfile"]["Arn"].split("/")[-1]
    assert profile_name == "ray-autoscaler-v1"
    (role,) = aws.iam.get_instance_profile(InstanceProfileName=profile_name)["InstanceProfile"]["Roles"]
    attached = {p["PolicyName"] for p in aws.iam.list_attached_role_policies(RoleName=role["RoleName"])[
        "AttachedPolicies"]}
    assert attached == {"AmazonEC2FullAccess", "AmazonS3FullAccess"}
    trust = role["AssumeRolePolicyDocument"]["Statement"][0]
    assert trust["Principal"] == {"Service": "ec2.amazonaws.com"} and trust["Action"] == "sts:AssumeRole"

    # ---- what the head is set up with (the recorded SSH session)
    (setup,) = Recorder.given
    docker = setup.kw["docker_config"]
    assert docker["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"  # this Ray, the project's Python
    assert any(f'"ray[tune]=={ray.__version__}"' in c and "pip install" in c for c in setup.kw["setup_commands"])
    start = setup.kw["ray_start_commands"]
    pin = [i for i, c in enumerate(start) if "rayfed_dg.cluster pin-image ~/ray_bootstrap_config.yaml" in c]
    up = [i for i, c in enumerate(start) if "ray start --head" in c and "--autoscaling-config=~/ray_bootstrap" in c]
    assert pin and up and pin[0] < up[0]
    shared = {o.split("=", 1)[1] for o in docker["run_options"] if o.startswith("--env=")}
    assert shared == {"RAYFED_DG_DATA=/mnt/shared/data", "TORCH_HOME=/mnt/shared/torch"}
    assert "--volume=/mnt/shared:/mnt/shared" in docker["run_options"]
    assert any("/etc/exports.d" in c and "/mnt/shared" in c for c in setup.kw["initialization_commands"])

    # ---- on the head (whose home is the test's): pin-image on the config ray up uploaded; the instance
    # metadata there would say the head's AMI
    assert set(setup.uploads) == {"~/ray_bootstrap_config.yaml", "~/ray_bootstrap_key.pem"}
    for name, text in setup.uploads.items():
        (aws.home / name[2:]).write_text(text)
    remote = aws.home / "ray_bootstrap_config.yaml"
    monkeypatch.setattr(rcluster, "instance_image", lambda: head["ImageId"])
    assert rcluster.main(["pin-image", str(remote)]) == 0
    pinned = yaml.safe_load(remote.read_text())
    assert {n: t["node_config"]["ImageId"] for n, t in pinned["available_node_types"].items()} == \
           {"ray.head.default": head["ImageId"], "gpu_worker": head["ImageId"]}
    mounts = pinned["available_node_types"]["gpu_worker"]["initialization_commands"]
    (mount,) = [c for c in mounts if "$RAY_HEAD_IP:/mnt/shared /mnt/shared" in c]
    assert "-o soft," in mount  # the share holds only what can be fetched again: an error, not a hang, without it

    # ---- the head's autoscaler (v2): plan for a demand, launch through the AWS node provider
    reader = FileConfigReader(str(remote), skip_content_hash=True)
    asc = reader.get_cached_autoscaling_config()

    def plan(gpus):  # what the autoscaler launches for `gpus` pending one-GPU tasks/actors
        demand = [ResourceRequestByCount(request=ResourceRequestUtil.make({"GPU": 1}), count=gpus)] if gpus else []
        reply = ResourceDemandScheduler().schedule(SchedulingRequest(
            node_type_configs=asc.get_node_type_configs(), max_num_nodes=asc.get_max_num_nodes(),
            resource_requests=demand, disable_launch_config_check=True))
        return {r.instance_type: r.count for r in reply.to_launch}, reply

    assert plan(0)[0] == {}  # min_workers 0: nothing without work
    assert plan(3)[0] == {"gpu_worker": 3}
    shape, reply = plan(6)  # six: four g5.xlarge (max_workers) and no more; two stay unplaced
    assert shape == {"gpu_worker": 4} and len(reply.infeasible_resource_requests) == 2
    adapter = NodeProviderAdapter(AWSNodeProvider(pinned["provider"], pinned["cluster_name"]), reader)
    adapter.launch(shape, request_id="rehearsal")
    deadline = time.monotonic() + 60
    while len(_instances(ec2)) < 5:
        assert not (errors := adapter.poll_errors()), [repr(e.__cause__) for e in errors]
        assert time.monotonic() < deadline, "the workers were not launched within 60 s"
        time.sleep(0.2)
    workers = [i for i in _instances(ec2) if i["InstanceId"] != head["InstanceId"]]
    assert len(workers) == 4
    # launched with the head's AMI id: the head's role needs no SSM permission
    assert sorted(aws.runs[1:]) == [("g5.xlarge", head["ImageId"])] * len(aws.runs[1:])
    for w in workers:
        assert w["InstanceType"] == "g5.xlarge" and w["ImageId"] == head["ImageId"] == aws.image
        assert [g["GroupId"] for g in w["SecurityGroups"]] == [sg["GroupId"]]
        # the head's profile, which Ray gives the head only: a trial on this node writes its checkpoints to S3
        assert w["IamInstanceProfile"]["Arn"] == head["IamInstanceProfile"]["Arn"]
        assert w["KeyName"] == head["KeyName"]
        tags = _tags(w)
        assert (tags["ray-cluster-name"], tags["ray-node-type"], tags["ray-user-node-type"],
                tags["Name"], tags["ray-launch-request"]) == \
               ("rayfed-dg", "worker", "gpu_worker", "ray-rayfed-dg-worker", "rehearsal")
    print(f"\nray up of cluster.yaml against moto: head {head['InstanceType']} + {len(workers)} x g5.xlarge from "
          f"{DLAMI}, group {GROUP} ({len(perms)} ingress rules), profile {profile_name}; "
          f"{time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("driver, ok", [("570.172.08", False), ("580.65.05", False), ("580.65.06", True),
                                         ("580.105.08", True), ("595.58.03", True), ("", False)])
def test_a_gpu_worker_refuses_a_driver_older_than_cuda_13(tmp_path, driver, ok):
    """A worker's first step, on the host: with an older driver torch 2.14.1 (CUDA 13.0) sees no GPU and the node
    would join and train on its CPU; it must fail its setup instead.  Run with bash on a stand-in nvidia-smi."""
    import shutil
    import subprocess

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    check = yaml.safe_load((REPO / "cluster.yaml").read_text())["available_node_types"]["gpu_worker"][
        "initialization_commands"][0]
    assert "nvidia-smi" in check
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho '{driver}'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    r = subprocess.run(["bash", "-c", check], env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode == 0) == ok, (driver, r.returncode, r.stderr)
    assert ok or "older than 580.65.06" in r.stderr
