"""The manifests of `phalanx k8s`, validated against the schemas the cluster checks them with.

The Job and Service against Kubernetes' own OpenAPI schemas (the ``kubernetes-validate``
package, strict: an unknown field is an error), for Kubernetes 1.29 and the newest it has (the
1.26 to 1.28 schemas list a podFailurePolicy rule's ``onPodConditions`` as required, though the
API server takes a rule with ``onExitCodes`` alone, as the Kubernetes documentation's example
has it). The TrainJob and PyTorchJob against their CRDs' ``openAPIV3Schema``, vendored in
tests/k8s_schemas/ (its README names their versions), with unknown fields refused as the API
server's strict field validation does. No control plane runs here: tests/netns/test_k8s_pods.py
runs the pods' commands on test-bed hosts instead.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from phalanx.cli.main import main

SCHEMAS = Path(__file__).parents[1] / "k8s_schemas"
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
IMAGE = "registry.example.com/me/train:1.0"


def strict(schema: object) -> object:
    """A CRD schema that refuses unknown fields, as ``kubectl apply`` (strict field validation) does."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):  # fmt: skip
            schema["additionalProperties"] = False
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the vendored CRD's schema of that version."""
    schemas = {}
    for path in SCHEMAS.glob("*.yaml"):
        (crd,) = [document for document in yaml.safe_load_all(path.read_text()) if document]
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            schemas[key] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


CRDS = crd_schemas()


def validate(manifest: dict) -> None:
    """Raises if the cluster would refuse the object: Kubernetes' schema, or its CRD's."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key in CRDS:
        jsonschema.validate(manifest, CRDS[key])
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)


def render(capsys, *argv: str) -> list[dict]:
    assert main(["k8s", "--image", IMAGE, *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Written by phalanx ")
    return list(yaml.safe_load_all(out))


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {manifest["kind"]: manifest for manifest in manifests}


ALL_OPTIONS = ("--nnodes", "3", "--gpus-per-node", "4", "--cpu", "8", "--memory", "64Gi", "--env", "NCCL_DEBUG=INFO",
               "--env", "OPTS=a=b", "--namespace", "ml", "--max-restarts", "1", "--name", "resnet")  # fmt: skip


@pytest.mark.parametrize("kind", ["indexed-job", "trainjob", "pytorchjob"])
@pytest.mark.parametrize(
    "options", [(), ALL_OPTIONS, ("--nnodes", "2", "-m", "pkg.train")], ids=["minimal", "all", "module"]
)
def test_every_kind_passes_its_schema(capsys, kind, options):
    manifests = render(capsys, "--kind", kind, *options, *(() if "-m" in options else ("train.py",)), "--epochs", "3")
    assert [m["kind"] for m in manifests] == {"indexed-job": ["Service", "Job"], "trainjob": ["TrainJob"],
                                              "pytorchjob": ["PyTorchJob"]}[kind]  # fmt: skip
    for manifest in manifests:
        validate(manifest)
        if "--namespace" in options:
            assert manifest["metadata"]["namespace"] == "ml"


@pytest.mark.parametrize(
    ("kind", "break_it", "says"),
    [
        ("indexed-job", lambda m: m["spec"].update(completions="2"), "'2' is not of type 'integer'"),
        ("indexed-job", lambda m: m["spec"]["template"]["spec"].update(subDomain="x"), "'subDomain' was unexpected"),
        ("trainjob", lambda m: m["spec"]["trainer"].update(numNodes="2"), "'2' is not of type 'integer'"),
        ("trainjob", lambda m: m["spec"].pop("runtimeRef"), "'runtimeRef' is a required property"),
        ("pytorchjob", lambda m: m["spec"].update(nprocPerNode=2), "2 is not of type 'string'"),
        (
            "pytorchjob",
            lambda m: m["spec"]["pytorchReplicaSpecs"]["Master"].update(replica=1),
            "'replica' was unexpected",
        ),
    ],
)
def test_a_broken_manifest_is_refused_by_the_same_validation(capsys, kind, break_it, says):
    manifest = render(capsys, "--kind", kind, "--nnodes", "2", "train.py")[-1]
    validate(manifest)
    broken = copy.deepcopy(manifest)
    break_it(broken)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)) as refused:
        validate(broken)
    assert says in str(refused.value)


def test_the_trainjob_crds_own_rules_concern_no_field_phalanx_writes(capsys):
    """The CEL rules (x-kubernetes-validations) are not evaluated here: none concerns what phalanx writes."""
    (trainjob,) = render(capsys, "--kind", "trainjob", *ALL_OPTIONS, "train.py")
    spec = CRDS[("trainer.kubeflow.org/v1alpha1", "TrainJob")]["properties"]["spec"]["properties"]
    ruled = {name for name, field in spec.items() if any("oldSelf" not in rule["rule"] for rule in
                                                          _rules(field))}  # fmt: skip
    assert ruled == {"initializer", "managedBy"} and not ruled & set(trainjob["spec"])


def _rules(schema: object) -> list[dict]:
    if isinstance(schema, dict):
        return list(schema.get("x-kubernetes-validations", [])) + [r for v in schema.values() for r in _rules(v)]
    return [r for v in schema for r in _rules(v)] if isinstance(schema, list) else []


def test_an_indexed_job_and_the_headless_service_that_names_its_pods(capsys):
    manifests = by_kind(render(capsys, *ALL_OPTIONS, "--headless-service", "workers", "train.py", "--epochs", "3"))
    service, job = manifests["Service"], manifests["Job"]
    assert service["metadata"]["name"] == "workers" and job["metadata"]["name"] == "resnet"
    assert service["spec"] == {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {"job-name": "resnet"},
    }
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        3,
        3,
        9,
    )
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In", "values": [2, 5]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "workers" and pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    (container,) = pod["containers"]
    assert container["name"] == "train" and container["image"] == IMAGE
    assert container["command"] == ["phalanx", "run", "--nnodes", "3", "--nproc-per-node", "4", "--headless-service",
                                    "workers", "--max-restarts", "1", "train.py", "--epochs", "3"]  # fmt: skip
    assert container["env"] == [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "NCCL_DEBUG", "value": "INFO"},
                                {"name": "OPTS", "value": "a=b"}]  # fmt: skip
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 4}, "requests": {"cpu": "8", "memory": "64Gi"}}
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]


def test_a_trainjob_gives_the_shape_to_the_trainer(capsys):
    (trainjob,) = render(capsys, "--kind", "trainjob", *ALL_OPTIONS, "--runtime", "torch-cuda", "train.py")
    spec = trainjob["spec"]
    assert spec["runtimeRef"] == {"name": "torch-cuda"}
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (3, 4, IMAGE)
    assert trainer["command"] == ["phalanx", "run", "--max-restarts", "1", "train.py"]  # the Trainer gives the rest
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 4}, "requests": {"cpu": "8", "memory": "64Gi"}}
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in trainer["env"]
    (patch,) = spec["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert pod["containers"] == [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]


def test_a_pytorchjob_has_a_master_and_the_other_nodes_as_workers(capsys):
    (job,) = render(capsys, "--kind", "pytorchjob", *ALL_OPTIONS, "train.py")
    spec = job["spec"]
    assert spec["nprocPerNode"] == "4" and spec["runPolicy"] == {"backoffLimit": 9}
    replicas = spec["pytorchReplicaSpecs"]
    assert {role: (r["replicas"], r["restartPolicy"]) for role, r in replicas.items()} == {
        "Master": (1, "OnFailure"), "Worker": (2, "OnFailure")}  # fmt: skip
    (container,) = replicas["Worker"]["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["ports"] == [
        {"name": "pytorchjob-port", "containerPort": 23456}
    ]
    assert container["command"] == ["phalanx", "run", "--max-restarts", "1", "train.py"]
    assert "PYTHONUNBUFFERED" not in str(container["env"])  # the operator sets it itself
    (single,) = render(capsys, "--kind", "pytorchjob", "train.py")
    assert list(single["spec"]["pytorchReplicaSpecs"]) == ["Master"]


@pytest.mark.parametrize(("options", "nproc"), [((), 1), (("--gpus-per-node", "8"), 8),
                                                (("--gpus-per-node", "8", "--nproc-per-node", "2"), 2)])  # fmt: skip
def test_processes_per_node_default_to_the_gpus(capsys, options, nproc):
    (trainjob,) = render(capsys, "--kind", "trainjob", *options, "train.py")
    assert trainjob["spec"]["trainer"]["numProcPerNode"] == nproc


def test_the_config_file_becomes_flags_and_this_shells_variables_stay_here(capsys, tmp_path, monkeypatch):
    config = tmp_path / "launch.toml"
    config.write_text("nnodes = 2\njoin-timeout = 600\nall-ranks = true\nindependent-ranks = false\n")
    monkeypatch.setenv("PHALANX_MAX_RESTARTS", "5")  # this shell's: the pods never see it
    manifests = by_kind(render(capsys, "--config", str(config), "--env", "PHALANX_BACKEND=gloo", "train.py"))
    (container,) = manifests["Job"]["spec"]["template"]["spec"]["containers"]
    assert manifests["Job"]["spec"]["completions"] == 2
    assert container["command"] == ["phalanx", "run", "--nnodes", "2", "--nproc-per-node", "1", "--headless-service",
                                    "train", "--join-timeout", "600", "--all-ranks", "train.py"]  # fmt: skip
    assert {"name": "PHALANX_BACKEND", "value": "gloo"} in container["env"]


@pytest.mark.parametrize(("script", "name"), [("examples/Train_DDP.py", "train-ddp"), ("2d_unet.py", "d-unet")])
def test_the_jobs_name_comes_from_the_script(capsys, script, name):
    assert by_kind(render(capsys, script))["Job"]["metadata"]["name"] == name


def test_output_writes_one_file_per_object(capsys, tmp_path):
    folder = tmp_path / "k8s" / "train"
    assert main(["k8s", "--image", IMAGE, "--nnodes", "2", "--output", str(folder), "train.py"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == [str(folder / "service-train.yaml"), str(folder / "job-train.yaml")]
    assert sorted(p.name for p in folder.iterdir()) == ["job-train.yaml", "service-train.yaml"]  # no temporary left
    (job,) = [d for d in yaml.safe_load_all((folder / "job-train.yaml").read_text()) if d]
    assert job["kind"] == "Job" and job["spec"]["completions"] == 2
    assert main(["k8s", "--image", IMAGE, "--nnodes", "3", "--output", str(folder), "train.py"]) == 0  # replaced
    assert yaml.safe_load((folder / "job-train.yaml").read_text())["spec"]["completions"] == 3


# -- refusals: exit 2, PROBLEM and HINT, nothing written ------------------------------------------
REFUSALS = [
    ([], "no --image given"),
    (["--kind", "deployment"], "--kind 'deployment' is not a kind phalanx k8s writes"),
    (["--name", "Train_1"], "--name 'Train_1' is not a valid Kubernetes name"),
    (["--name", "t" * 61, "--nnodes", "100"], "is too long: the pods' host names would be up to 64 characters"),
    (["--env", "NCCL_DEBUG"], "--env 'NCCL_DEBUG' has no NAME=VALUE"),
    (["--env", "1X=2"], "'1X' is not an environment variable's name"),
    (["--env", "A=1", "--env", "A=2"], "--env A is given twice"),
    (["--nnodes", "0"], "--nnodes 0: a job needs at least 1 node"),
    (["--nnodes", "2:4"], "--nnodes 2:4 (from --nnodes): a manifest's node count is a fixed number"),
    (["--nproc-per-node", "auto"], "--nproc-per-node auto (from --nproc-per-node): the manifest needs a number"),
    (["--simulate-nodes", "2"], "--simulate-nodes with phalanx k8s --kind indexed-job (from --simulate-nodes)"),
    (["--standalone"], "--standalone with phalanx k8s"),
    (["--dry-run"], "--dry-run with phalanx k8s"),
    (["--env", "PHALANX_SIMULATE_NODES=2"], "(from PHALANX_SIMULATE_NODES=2)"),
    (["--kind", "trainjob", "--rdzv-endpoint", "10.0.0.1"], "--rdzv-endpoint with phalanx k8s --kind trainjob"),
    (["--kind", "pytorchjob", "--headless-service", "x"], "--headless-service with phalanx k8s --kind pytorchjob"),
    (["--kind", "trainjob", "--env", "PET_NNODES=2"], "--env PET_NNODES with --kind trainjob"),
    (["--kind", "pytorchjob", "--env", "MASTER_ADDR=x"], "--env MASTER_ADDR with --kind pytorchjob"),
    (["--env", "JOB_COMPLETION_INDEX=0"], "--env JOB_COMPLETION_INDEX with --kind indexed-job"),
    (["--runtime", "torch-distributed"], "--runtime torch-distributed with --kind indexed-job"),
    (["--kind", "trainjob", "--backoff-limit", "3"], "--backoff-limit with --kind trainjob"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1, not 0"),
    (["--memory", "64GB"], "--memory '64GB' is not a Kubernetes resource quantity"),
    (["--namespace", "ML"], "--namespace 'ML' is not a Kubernetes namespace's name"),
    (["--image", "my image"], "--image 'my image' is not a container image"),
    (["--volume", "ckpt"], "--volume 'ckpt' has no CLAIM:PATH"),
    (["--volume", "Ckpt:/ckpt"], "'Ckpt' is not a PersistentVolumeClaim's name"),
    (["--volume", "c:/dev/shm"], "'/dev/shm' cannot be a mount point here"),
    (["--volume", "c:ckpt"], "'ckpt' cannot be a mount point here"),
    (["--volume", "c:/ck\npt"], "cannot be a mount point here"),
    (["--volume", "a:/ckpt", "--volume", "b:/ckpt/"], "'/ckpt' cannot be a mount point here"),
]


@pytest.mark.parametrize(("argv", "says"), REFUSALS, ids=[says[:40] for _, says in REFUSALS])
def test_bad_input_is_refused_before_anything_is_written(capsys, tmp_path, argv, says):
    image = [] if not argv or argv[0] == "--image" else ["--image", IMAGE]
    folder = tmp_path / "out"
    assert main(["k8s", *image, *argv, "--output", str(folder), "train.py"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not folder.exists()
    assert captured.err.startswith("phalanx: error: ") and "\nHINT: " in captured.err, captured.err
    assert says in captured.err, captured.err


def test_an_output_that_is_a_file_is_refused_and_left_alone(capsys, tmp_path):
    output = tmp_path / "k8s"
    output.write_text("mine")
    assert main(["k8s", "--image", IMAGE, "--output", str(output / "sub"), "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"--output {output / 'sub'}: {output} is a file, not a folder" in err and "\nHINT: " in err
    assert output.read_text() == "mine"


def test_a_file_that_would_replace_a_folder_is_refused_before_anything_is_written(capsys, tmp_path):
    folder = tmp_path / "k8s"
    (folder / "job-train.yaml").mkdir(parents=True)  # the second file cannot replace a folder
    assert main(["k8s", "--image", IMAGE, "--output", str(folder), "train.py"]) == 2
    assert "job-train.yaml there is a folder, where phalanx k8s writes a file" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["job-train.yaml"]


def test_a_folder_that_cannot_be_written_is_refused(capsys):
    assert main(["k8s", "--image", IMAGE, "--output", "/proc/phalanx-k8s", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--output /proc/phalanx-k8s: the manifests cannot be written there" in err and "\nHINT: " in err


def pod_specs(manifests: list[dict]) -> list[dict]:
    """Every pod spec the manifests give (a TrainJob's: its patch of the runtime's pods)."""
    found = []
    for manifest in manifests:
        spec = manifest.get("spec", {})
        if manifest["kind"] == "Job":
            found.append(spec["template"]["spec"])
        elif manifest["kind"] == "PyTorchJob":
            found += [replica["template"]["spec"] for replica in spec["pytorchReplicaSpecs"].values()]
        elif manifest["kind"] == "TrainJob":  # the runtime's pods, through phalanx's patch
            for patch in spec["runtimePatches"]:
                for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
                    found.append(job["template"]["spec"]["template"]["spec"])
    return found


@pytest.mark.parametrize("kind", ["indexed-job", "trainjob", "pytorchjob"])
def test_a_checkpoint_folder_on_a_claim_is_mounted_in_every_pod(capsys, kind):
    manifests = render(capsys, "--kind", kind, "--nnodes", "2", "--volume", "ckpt:/ckpt", "--volume", "datasets.v1:/data",
                       "train.py", "--checkpoint-dir", "/ckpt/run1")  # fmt: skip
    pods = pod_specs(manifests)
    assert pods, manifests
    for pod_spec in pods:
        assert pod_spec["volumes"][1:] == [
            {"name": "volume-0", "persistentVolumeClaim": {"claimName": "ckpt"}},
            {"name": "volume-1", "persistentVolumeClaim": {"claimName": "datasets.v1"}},
        ]
        (container,) = pod_spec["containers"]
        assert container["volumeMounts"][1:] == [{"name": "volume-0", "mountPath": "/ckpt"},
                                                 {"name": "volume-1", "mountPath": "/data"}], container  # fmt: skip
    for manifest in manifests:
        validate(manifest)


@pytest.mark.parametrize("given", [["--checkpoint-dir", "/ckpt"], ["--checkpoint-dir=/work/ck"]])
def test_a_checkpoint_folder_on_the_pods_own_filesystem_is_refused(capsys, given):
    """A retried or rescheduled pod starts with an empty filesystem: its checkpoints would be gone."""
    assert main(["k8s", "--image", IMAGE, "--volume", "data:/data", "train.py", *given]) == 2
    err = capsys.readouterr().err
    folder = given[-1].split("=")[-1]
    assert f"the script's --checkpoint-dir {folder} is on the pod's own filesystem" in err, err
    assert f"HINT: mount a PersistentVolumeClaim there: --volume CLAIM:{folder}" in err, err


def test_a_launch_variable_of_this_shell_is_said_not_to_reach_the_pods(capsys, monkeypatch):
    monkeypatch.setenv("PHALANX_JOIN_TIMEOUT", "60")
    assert main(["k8s", "--image", "registry.example.com/train:1", "train.py"]) == 0
    note = "phalanx k8s: note: PHALANX_JOIN_TIMEOUT is set in this shell, but the pods do not see it"
    assert note in capsys.readouterr().err
    assert main(["k8s", "--image", "registry.example.com/train:1", "--env", "PHALANX_JOIN_TIMEOUT=60", "train.py"]) == 0
    assert "note:" not in capsys.readouterr().err  # given to the pods: nothing to say
