"""Typed values keep the wire shape: stored JSON is what the API sent, and what it reads back."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Integer, create_engine, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from hyperpod_sim.models.values import ValueJSON, WireValue


class Sample(WireValue):
    instance_type: str
    instance_count: int | None = None


class _Base(DeclarativeBase):
    pass


class _Row(_Base):
    __tablename__ = "rows"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    one: Mapped[Sample | None] = mapped_column(ValueJSON(Sample))
    many: Mapped[list[Sample] | None] = mapped_column(ValueJSON(list[Sample]))


def test_a_value_round_trips_through_its_wire_shape_with_members_it_does_not_name() -> None:
    sent = {"InstanceType": "ml.c5.xlarge", "InstanceCount": 2, "LifeCycleConfig": {"SourceS3Uri": "s3://b"}}
    value = Sample.from_wire(sent)
    assert (value.instance_type, value.instance_count) == ("ml.c5.xlarge", 2)
    assert value.wire() == sent
    assert Sample.from_wire({"InstanceType": "ml.c5.xlarge"}).wire() == {"InstanceType": "ml.c5.xlarge"}


def test_a_value_column_stores_the_wire_json_and_loads_the_value(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'v.db'}")
    _Base.metadata.create_all(engine)
    with Session(engine) as session:
        session.add(
            _Row(id=1, one=Sample(instance_type="a"), many=[Sample(instance_type="b", instance_count=1)])
        )
        session.commit()
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT one, many FROM rows")).one()
    assert stored == ('{"InstanceType": "a"}', '[{"InstanceType": "b", "InstanceCount": 1}]')
    with Session(engine) as session:
        row = session.get(_Row, 1)
        assert row is not None
        assert row.one == Sample(instance_type="a")
        assert row.many == [Sample(instance_type="b", instance_count=1)]
