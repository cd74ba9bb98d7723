"""The weight RPCs on the REAL trainer gRPC server with a real etcd: GetWeightVersion and
ListWeightVersions read the registry, PublishModel builds a built-in model here from its seed
(the same weights a client used to build itself), puts it in the artifact store once and
publishes it idempotently per version; a training job starts from the published location."""

from __future__ import annotations

import grpc
import torch

from orchard.core.errors import error_info
from orchard.lm.model_folder import load_model_folder
from orchard.trainer.policy import load_policy
from orchard.trainer.v1 import trainer_service_pb2 as api

from .test_service import failure, local, registry, sft_spec, submit, trainer, trainer_config

__all__ = ["registry", "trainer", "trainer_config"]  # fixtures used here


async def test_publish_model_builds_a_builtin_model_once_and_publishes_it(trainer, registry):
    t = await trainer.start()
    request = api.PublishModelRequest(
        model="builtin:tiny", weight_model="run-b-student", version="base", seed=3
    )
    first = await t.stub.PublishModel(request)
    assert first.created
    published = first.weight_version
    assert (published.model, published.version, published.number) == ("run-b-student", "base", 1)
    assert published.metadata["source"] == "builtin:tiny" and published.metadata["seed"] == "3"
    assert published.publish_time.seconds > 0

    # The folder holds exactly the weights a built-in model of that seed has.
    folder = local(published.location)
    assert folder.parent.name == "models" and (folder / "config.json").is_file()
    saved = load_model_folder(folder).model.state_dict()
    built = load_policy("builtin:tiny", seed=3).model.state_dict()
    assert saved.keys() == built.keys()
    assert all(torch.equal(saved[k], built[k]) for k in built)

    # A retry returns the same version and builds nothing new.
    again = await t.stub.PublishModel(request)
    assert not again.created and again.weight_version == published
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]

    # The registry has it: the engines see what the RPCs say.
    record = await registry.for_model("run-b-student").get("base")
    assert record is not None and record.location == published.location

    # Another seed under the same version is a conflict, not a silent overwrite.
    code, message = await failure(
        t.stub.PublishModel(
            api.PublishModelRequest(
                model="builtin:tiny", weight_model="run-b-student", version="base", seed=4
            )
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and "seed 3" in message

    # A training job started from the published location trains and publishes on top.
    spec = sft_spec(model=published.location, total_steps=1, weight_model="run-b-student")
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    from .test_service import groups

    await submit(t.stub, job.id, groups(1, 4))
    stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=1, publish=True))
    latest = await t.stub.GetWeightVersion(api.GetWeightVersionRequest(model="run-b-student"))
    assert latest.weight_version.version == stepped.weight_version
    assert latest.weight_version.number == 2


async def test_publish_model_takes_a_model_folder_url_and_refuses_bad_ones(trainer, tmp_path):
    t = await trainer.start()
    base = await t.stub.PublishModel(
        api.PublishModelRequest(model="builtin:tiny", weight_model="a", version="base")
    )
    url = base.weight_version.location
    reply = await t.stub.PublishModel(
        api.PublishModelRequest(model=url, weight_model="b", version="base")
    )
    assert reply.created and reply.weight_version.location == url
    assert "seed" not in reply.weight_version.metadata
    again = await t.stub.PublishModel(
        api.PublishModelRequest(model=url, weight_model="b", version="base")
    )
    assert not again.created

    outside = (tmp_path / "elsewhere").as_uri()
    cases = [
        (api.PublishModelRequest(model="builtin:huge", weight_model="c", version="base"),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (api.PublishModelRequest(model="", weight_model="c", version="base"),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (api.PublishModelRequest(model=url, weight_model="c", version="no/slash"),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (api.PublishModelRequest(model=url, weight_model="bad name", version="base"),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (api.PublishModelRequest(model=outside, weight_model="c", version="base"),
         grpc.StatusCode.PERMISSION_DENIED, "ARTIFACT_ACCESS_DENIED"),
        (api.PublishModelRequest(model=f"{url}-missing", weight_model="c", version="base"),
         grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND"),
        (api.PublishModelRequest(model="/a/path", weight_model="c", version="base"),
         grpc.StatusCode.INVALID_ARGUMENT, "ARTIFACT_URL_INVALID"),
        # the same version from another source (b's base is the folder, not a built model)
        (api.PublishModelRequest(model="builtin:tiny", weight_model="b", version="base"),
         grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS"),
    ]  # fmt: skip
    for request, code, reason in cases:
        with_status = await _status(t.stub.PublishModel(request))
        assert with_status[:2] == (code, reason), (request, with_status)
    listed = await t.stub.ListWeightVersions(api.ListWeightVersionsRequest(model="c"))
    assert list(listed.weight_versions) == []  # nothing refused was published


async def test_get_and_list_weight_versions_read_the_registry_a_page_at_a_time(trainer, registry):
    t = await trainer.start()
    own = registry.for_model("paged")
    for step in range(5):
        await own.publish(f"step-{step}", f"file:///models/paged/{step}", {"step": str(step)})

    found = await t.stub.GetWeightVersion(
        api.GetWeightVersionRequest(model="paged", version="step-2")
    )
    assert (found.weight_version.number, found.weight_version.location) == (
        3, "file:///models/paged/2",
    )  # fmt: skip
    assert found.weight_version.metadata["step"] == "2"
    latest = await t.stub.GetWeightVersion(api.GetWeightVersionRequest(model="paged"))
    assert latest.weight_version.version == "step-4"

    seen, token, pages = [], "", 0
    while True:
        page = await t.stub.ListWeightVersions(
            api.ListWeightVersionsRequest(model="paged", page_size=2, page_token=token)
        )
        pages += 1
        seen += [v.version for v in page.weight_versions]
        token = page.next_page_token
        if not token:
            break
    assert pages == 3 and seen == [f"step-{i}" for i in range(5)]
    whole = await t.stub.ListWeightVersions(api.ListWeightVersionsRequest(model="paged"))
    assert [v.number for v in whole.weight_versions] == [1, 2, 3, 4, 5]
    assert not whole.next_page_token

    # the service's own model when none is named
    await registry.publish("v1", "file:///models/own/1")
    own_latest = await t.stub.GetWeightVersion(api.GetWeightVersionRequest())
    assert (own_latest.weight_version.model, own_latest.weight_version.version) == ("policy", "v1")

    for call, code in [
        (t.stub.GetWeightVersion(api.GetWeightVersionRequest(model="paged", version="nope")),
         grpc.StatusCode.NOT_FOUND),
        (t.stub.GetWeightVersion(api.GetWeightVersionRequest(model="never")),
         grpc.StatusCode.NOT_FOUND),
        (t.stub.GetWeightVersion(api.GetWeightVersionRequest(model="bad name")),
         grpc.StatusCode.INVALID_ARGUMENT),
        (t.stub.ListWeightVersions(api.ListWeightVersionsRequest(model="paged", page_size=-1)),
         grpc.StatusCode.INVALID_ARGUMENT),
        (t.stub.ListWeightVersions(
            api.ListWeightVersionsRequest(model="paged", page_token="not-a-token")),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]:  # fmt: skip
        assert (await failure(call))[0] == code


async def _status(call) -> tuple[grpc.StatusCode, str, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        info = error_info(exc)
        return exc.code(), info.reason if info else "", exc.details() or ""
    raise AssertionError("the call succeeded")
