"""reproducible on unittest.TestCase classes.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import unittest

from deterministic_ctx import reproducible
from tests.helpers import draw, solo


def _run(case_cls: type[unittest.TestCase]) -> unittest.TestResult:
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(case_cls)
    result = unittest.TestResult()
    suite.run(result)
    return result


def test_every_test_method_runs_in_a_fresh_block_with_setup_and_teardown_inside():
    record: dict[str, list] = {}

    @reproducible(seed=4)
    class Case(unittest.TestCase):
        def setUp(self):
            self.values = [draw()]

        def tearDown(self):
            self.values.append(draw())
            record[self._testMethodName] = self.values

        def test_a(self):
            self.values.append(draw())

        def test_b(self):
            self.values.append(draw())

    result = _run(Case)
    assert result.wasSuccessful(), result.errors + result.failures
    assert record["test_a"] == record["test_b"] == solo(4, 3)


def test_inherited_setup_and_cleanups_run_inside():
    class Base(unittest.TestCase):
        def setUp(self):
            self.first = draw()

    cleanup_values = []

    @reproducible(seed=4)
    class Case(Base):
        def test_x(self):
            self.addCleanup(lambda: cleanup_values.append(draw()))
            self.assertEqual(self.first, solo(4, 1)[0])

    result = _run(Case)
    assert result.wasSuccessful(), result.errors + result.failures
    assert cleanup_values == [solo(4, 2)[1]]


def test_failing_setup_and_test_leave_no_state():
    @reproducible
    class Case(unittest.TestCase):
        def setUp(self):
            draw()
            if self._testMethodName == "test_setup_fails":
                raise RuntimeError("setUp")

        def test_setup_fails(self):
            pass

        def test_body_fails(self):
            draw()
            self.fail("body")

    result = _run(Case)
    assert len(result.errors) == 1 and len(result.failures) == 1


def test_set_up_class_runs_in_a_block_even_when_it_raises_or_skips():
    made = []

    @reproducible(seed=8)
    class Good(unittest.TestCase):
        @classmethod
        def setUpClass(cls):
            cls.data = draw()
            made.append(cls.data)

        def test_data(self):
            self.assertEqual(self.data, solo(8, 1)[0])

    @reproducible
    class Raises(unittest.TestCase):
        @classmethod
        def setUpClass(cls):
            draw()
            raise RuntimeError("setUpClass")

        def test_never(self):
            pass

    @reproducible
    class Skips(unittest.TestCase):
        @classmethod
        def setUpClass(cls):
            draw()
            raise unittest.SkipTest("no GPU")

        def test_never(self):
            pass

    assert _run(Good).wasSuccessful()
    assert made == [solo(8, 1)[0]]
    assert len(_run(Raises).errors) == 1
    assert len(_run(Skips).skipped) == 1


def test_isolated_asyncio_test_case():
    results = []

    @reproducible(seed=2)
    class Case(unittest.IsolatedAsyncioTestCase):
        async def test_async(self):
            results.append(draw())

    assert _run(Case).wasSuccessful()
    assert results == solo(2, 1)


def test_closest_decoration_wins_for_a_decorated_subclass():
    # The subclass's seed, not the base's, in one block for the inherited
    # setUp, setUpClass, the test and tearDown.
    record: dict[str, object] = {}

    @reproducible(seed=3)
    class Base(unittest.TestCase):
        @classmethod
        def setUpClass(cls):
            record["class"] = draw()

        def setUp(self):
            self.values = [draw()]

        def tearDown(self):
            self.values.append(draw())
            record[type(self).__name__] = self.values

        def test_it(self):
            self.values.append(draw())

    @reproducible(seed=5)
    class Sub(Base):
        pass

    assert _run(Sub).wasSuccessful()
    assert record["Sub"] == solo(5, 3)
    assert record["class"] == solo(5, 1)[0]
    assert _run(Base).wasSuccessful()
    assert record["Base"] == solo(3, 3)
    assert record["class"] == solo(3, 1)[0]


def test_subclass_with_its_own_setup_calling_super():
    @reproducible(seed=3)
    class Base(unittest.TestCase):
        def setUp(self):
            self.values = [draw()]

    @reproducible(seed=5)
    class Sub(Base):
        def setUp(self):
            super().setUp()
            self.values.append(draw())

        def test_it(self):
            self.values.append(draw())
            self.assertEqual(self.values, solo(5, 3))

    result = _run(Sub)
    assert result.wasSuccessful(), result.errors + result.failures


def test_undecorated_subclass_inherits_the_base_decoration():
    @reproducible(seed=3)
    class Base(unittest.TestCase):
        pass

    class Sub(Base):
        def test_it(self):
            self.assertEqual([draw()], solo(3, 1))

    result = _run(Sub)
    assert result.wasSuccessful(), result.errors + result.failures
